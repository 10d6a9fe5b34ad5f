#!/usr/bin/env bash
# make sanitize: the project under the sanitizers, each configuration in its own build tree.
#
#   1. AddressSanitizer + UndefinedBehaviorSanitizer (build-asan, -DKVPOOL_SANITIZE=address):
#      every unit and integration test (the integration tests start the ASan kvpoold), then
#      kvpool-soak with SANITIZE_SOAK_CLIENTS clients for SANITIZE_SOAK_SECONDS.
#   2. ThreadSanitizer (build-tsan, -DKVPOOL_SANITIZE=thread): the server's unit tests, the
#      integration tests and a shorter soak (SANITIZE_TSAN_SOAK_SECONDS). Abseil is rebuilt with
#      TSan first (scripts/build-tsan-abseil.sh: Debian's absl::Mutex is invisible to TSan).
#
# ASan, LSan and TSan reports of every process (tests, the daemons they start, the soak) are
# written to BUILD/sanitizer-reports/. Any ASan or LSan report fails the run (printed); LSan
# suppressions (tests/sanitizers/lsan.supp) may name third-party code only, each with its reason.
# UBSan reports go to the process's stderr (GCC's runtime ignores log_path for them) and abort it
# (-fno-sanitize-recover), so they fail the test or the soak that hit them, quoted in its output
# (a daemon's in its log tail). TSan sees kvpool's memory and Abseil (rebuilt), not the internals
# of Debian's gRPC and protobuf, so its reports are triaged (tests/sanitizers/tsan_triage.py): a
# race whose two accesses are both kvpool's fails; the others are counted and listed.
#
# Settings (environment): SANITIZE_CONFIGS ("address thread"), SANITIZE_SOAK_SECONDS (180),
# SANITIZE_TSAN_SOAK_SECONDS (60), SANITIZE_SOAK_CLIENTS (16), SANITIZE_CTEST_ARGS (extra ctest
# arguments, e.g. "-R server"), JOBS (nproc), CMAKE_FLAGS.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
configs=${SANITIZE_CONFIGS:-address thread}
soak_seconds=${SANITIZE_SOAK_SECONDS:-180}
tsan_soak_seconds=${SANITIZE_TSAN_SOAK_SECONDS:-60}
soak_clients=${SANITIZE_SOAK_CLIENTS:-16}
ctest_args=${SANITIZE_CTEST_ARGS:-}
jobs=${JOBS:-$(nproc)}
supp=$repo/tests/sanitizers
launcher=()
if command -v ccache > /dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
started=$(date +%s)

say() { echo "== sanitize [$(( $(date +%s) - started ))s]: $*"; }

configure() {  # DIR SANITIZER
  cmake -S . -B "$1" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKVPOOL_SANITIZE="$2" -DKVPOOL_ENABLE_CUDA=OFF "${launcher[@]}" ${CMAKE_FLAGS:-} > /dev/null
}

# Fails (with every report printed) when a sanitizer wrote anything under DIR.
check_reports() {  # DIR WHAT
  local reports=("$1"/sanitizer-reports/*)
  if [ -e "${reports[0]}" ]; then
    for r in "${reports[@]}"; do
      echo "---- $r"
      cat "$r"
    done
    say "FAIL: $2: ${#reports[@]} sanitizer report(s), above"
    exit 1
  fi
}

# TSan reports: kvpool's races fail, races inside uninstrumented gRPC/protobuf are listed
# (tests/sanitizers/tsan_triage.py says how they are told apart). The reports are then moved
# aside so that the next phase is judged on its own.
triage_tsan() {  # DIR WHAT
  local reports=("$1"/sanitizer-reports/tsan.*)
  [ -e "${reports[0]}" ] || return 0
  python3 "$supp/tsan_triage.py" "$repo" "$repo/$1" "${reports[@]}" ||
    { say "FAIL: $2: ThreadSanitizer reports in kvpool code, above"; exit 1; }
  mkdir -p "$1/sanitizer-reports/triaged"
  mv "${reports[@]}" "$1/sanitizer-reports/triaged/"
}

# Ends one phase: JUDGE (check_reports or triage_tsan) reads the reports under DIR, then a
# FAILED status other than 0 fails the run.
end_phase() {  # JUDGE DIR WHAT FAILED
  "$1" "$2" "$3"
  [ "$4" = 0 ] || { say "FAIL: $3"; exit 1; }
}

# kvpool-soak of DIR with $soak_clients clients for SECONDS, judged by JUDGE.
run_soak() {  # DIR LABEL SECONDS JUDGE
  local failed=0
  say "$2: kvpool-soak, $soak_clients clients, ${3}s"
  "$1/bin/kvpool-soak" --clients="$soak_clients" --seconds="$3" || failed=1
  end_phase "$4" "$1" "$2 soak" "$failed"
}

run_asan() {
  local dir=build-asan
  say "ASan + UBSan: configure and build $dir"
  configure "$dir" address
  cmake --build "$dir" -j "$jobs"
  rm -rf "$dir/sanitizer-reports"
  mkdir -p "$dir/sanitizer-reports"
  local reports=$repo/$dir/sanitizer-reports
  # Leaks are checked at every exit (the daemon's clean SIGTERM exit included).
  export ASAN_OPTIONS="log_path=$reports/asan:detect_leaks=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
  say "ASan + UBSan: unit and integration tests"
  local failed=0
  # -LE model: the Python-driven calibration tests load the codec into python, which is not built
  # with ASan; their C++ parts run as unit tests.
  ctest --test-dir "$dir" -LE model --output-on-failure -j "$jobs" --timeout 1800 \
    $ctest_args || failed=1
  end_phase check_reports "$dir" "ASan + UBSan tests" "$failed"
  run_soak "$dir" "ASan + UBSan" "$soak_seconds" check_reports
  unset ASAN_OPTIONS UBSAN_OPTIONS LSAN_OPTIONS
  say "ASan + UBSan: clean"
}

run_tsan() {
  local dir=build-tsan
  say "TSan: Abseil with TSan (once), configure and build $dir"
  JOBS=$jobs "$repo/scripts/build-tsan-abseil.sh" "$dir/abseil-tsan"
  configure "$dir" thread
  # The server's unit tests, the integration tests and the soak (what they need comes along).
  make -C "$dir/server" -j "$jobs" --no-print-directory > "$dir/build-server.log" ||
    { tail -50 "$dir/build-server.log"; exit 1; }
  make -C "$dir/tests/integration" -j "$jobs" --no-print-directory > "$dir/build-tests.log" ||
    { tail -50 "$dir/build-tests.log"; exit 1; }
  make -C "$dir/tests/soak" -j "$jobs" --no-print-directory >> "$dir/build-tests.log" ||
    { tail -50 "$dir/build-tests.log"; exit 1; }
  rm -rf "$dir/sanitizer-reports"
  mkdir -p "$dir/sanitizer-reports"
  local reports=$repo/$dir/sanitizer-reports
  export LD_LIBRARY_PATH=$repo/$dir/abseil-tsan/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # Reports do not change exit codes (exitcode=0): tsan_triage.py decides which ones fail.
  export TSAN_OPTIONS="log_path=$reports/tsan:exitcode=0:history_size=4:second_deadlock_stack=1:halt_on_error=0"
  # UCX's malloc and mmap hooks patch the allocator under TSan's interceptors and crash; the tcp
  # and shared-memory transports do not need them.
  export UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_EVENTS=no
  local failed=0
  say "TSan: server unit tests"
  ctest --test-dir "$dir/server" --output-on-failure -j "$jobs" --timeout 1800 $ctest_args ||
    failed=1
  say "TSan: integration tests"
  ctest --test-dir "$dir/tests/integration" --output-on-failure -j "$jobs" --timeout 1800 \
    $ctest_args || failed=1
  end_phase triage_tsan "$dir" "TSan tests" "$failed"
  run_soak "$dir" "TSan" "$tsan_soak_seconds" triage_tsan
  unset TSAN_OPTIONS UCX_MEM_MALLOC_HOOKS UCX_MEM_MMAP_HOOK_MODE UCX_MEM_EVENTS
  say "TSan: clean"
}

for c in $configs; do
  case "$c" in
    address) run_asan ;;
    thread) run_tsan ;;
    *) echo "sanitize: unknown configuration '$c' (address, thread)" >&2; exit 2 ;;
  esac
done
say "PASS ($configs)"
