#!/usr/bin/env bash
# Runs fuzz targets built with KVPOOL_FUZZ=ON (make fuzz) under libFuzzer, one after the other,
# each for SECONDS, then prints per target: execs/s, coverage (cov: / ft:), corpus size, crashes.
#
#   tests/fuzz/run_fuzz.sh BUILD_DIR SECONDS "rpc_fuzz npy_fuzz"
#
# Each target reads its seeds (tests/fuzz/corpus/TARGET, never written) and writes new inputs to
# a scratch corpus BUILD_DIR/fuzz-corpus/TARGET (kept between runs) and crashing, leaking,
# timing-out or over-allocating inputs to BUILD_DIR/crashes/TARGET/. A run stops at its first
# finding. Limits: -rss_limit_mb=2048, -malloc_limit_mb=$FUZZ_MALLOC_LIMIT_MB (default 256: a
# single allocation above it from a small input is a finding), -timeout=$FUZZ_TIMEOUT seconds
# per input (default 10). The full log is BUILD_DIR/fuzz-logs/TARGET.log. Exit status 1 when any
# target found something.
set -uo pipefail

if [ $# -ne 3 ]; then
  echo "usage: $0 BUILD_DIR SECONDS \"TARGET...\"" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
seconds=$2
targets=$3
seeds=$(cd "$(dirname "$0")" && pwd)/corpus
malloc_limit=${FUZZ_MALLOC_LIMIT_MB:-256}
timeout=${FUZZ_TIMEOUT:-10}

rows=()
found=0
for t in $targets; do
  bin=$build/bin/fuzz/$t
  if [ ! -x "$bin" ]; then
    echo "run_fuzz: $bin is not built" >&2
    exit 2
  fi
  work=$build/fuzz-corpus/$t
  crashes=$build/crashes/$t
  log=$build/fuzz-logs/$t.log
  mkdir -p "$work" "$crashes" "$(dirname "$log")"
  echo "run_fuzz: $t for ${seconds}s (log $log)"
  "$bin" -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb="$malloc_limit" \
    -timeout="$timeout" -print_final_stats=1 -artifact_prefix="$crashes/" \
    "$work" "$seeds/$t" >"$log" 2>&1
  rc=$?
  # The last status line: "#N  DONE  cov: C ft: F corp: K/S ..." (or the last one before a crash).
  status_line=$(grep -E '^#[0-9]+' "$log" | grep 'cov:' | tail -n 1)
  cov=$(sed -nE 's/.*cov: ([0-9]+).*/\1/p' <<<"$status_line")
  ft=$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$status_line")
  corp=$(sed -nE 's/.*corp: ([0-9]+\/[0-9]+[a-zA-Z]*).*/\1/p' <<<"$status_line")
  execs=$(sed -nE 's/^stat::average_exec_per_sec: *([0-9]+).*/\1/p' "$log" | tail -n 1)
  n_crashes=$(find "$crashes" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' -o \
    -name 'timeout-*' -o -name 'oom-*' -o -name 'slow-unit-*' \) | wc -l)
  if [ "$rc" -ne 0 ]; then
    found=1
    grep -m 3 -E 'ERROR: libFuzzer|ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error|FUZZ_CHECK' \
      "$log" | sed "s/^/run_fuzz: $t: /"
  fi
  rows+=("$(printf '%-20s %10s %8s %8s %14s %8s %4s' "$t" "${execs:--}" "${cov:--}" "${ft:--}" \
    "${corp:--}" "$n_crashes" "$rc")")
done

printf '\n%-20s %10s %8s %8s %14s %8s %4s\n' target execs/s cov ft corpus crashes rc
printf '%s\n' "${rows[@]}"
echo "crashes (if any) are in $build/crashes/TARGET/; tests/fuzz/README.md says how to add one to the corpus"
exit "$found"
