#!/usr/bin/env bash
# kvpool GPU checks on the lent H200 machine: correctness (GPU vs CPU reference), the
# compute-sanitizer memcheck and racecheck, the kernel benchmark (ours vs torch SDPA BF16 vs the
# byte floor), and kvpoold --device=cuda:0 end to end (the integration suite of the CPU daemon
# against the GPU backend, and the GPU daemon benchmark). Uses the binaries and libraries that
# tests/gpu/package.sh built on the CPU machine (.gpu-carry/bundle.tar.xz, carried with the
# call), so nothing needs gRPC, protobuf, Abseil or UCX packages here.
#
#   bash tests/gpu/run.sh [all|test|sanitize|bench|quick|daemon|daemon-quick|decode-path|
#                          transport|attention|ab|profile|split-replay]
#
# (default: all). `ab` compares the decode attention of this bundle with a base bundle
# (.gpu-carry-base, carried too) and with this bundle under the tuning variants of AB_VARIANTS
# (kvpool-gpu-bench flags, see below); `profile` runs Nsight Compute on the attention kernels.
# `split-replay` replays the SmolLM2 split captured on the CPU machine (make gpu-replay-capture,
# carried as .gpu-replay/) against kvpoold --device=cuda:0.
# `transport` needs the two-GPU kind (nvidia-h200-x2): the GPU data plane
# (NCCL and CUDA IPC ingest beside raw NCCL and a peer copy, the three-transport check, the
# killed-prefill fault test, and remote attention over NCCL beside gRPC and the kernel, which
# `attention` runs alone); neither is part of `all`.
#
# Logs and JSON go to $OUT (the device tool's folder; ./gpu-out otherwise); the summary table
# prints last. Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT" bench-results
CARRY=${TMPDIR:-/tmp}/kvpool-gpu-carry
if [ -f .gpu-carry/bundle.tar.xz ]; then
  rm -rf "$CARRY" && mkdir -p "$CARRY" && tar -C "$CARRY" -xJf .gpu-carry/bundle.tar.xz
fi
BIN=$CARRY/bin
# NCCL is not carried (218 MB): the machine's PyTorch image has it in the nvidia-nccl wheel.
NCCL_DIR=$(python3 - <<'PY' 2>/dev/null
import glob, site, os
for d in site.getsitepackages():
    for f in glob.glob(os.path.join(d, "nvidia", "**", "libnccl.so.2"), recursive=True):
        print(os.path.dirname(f)); raise SystemExit
PY
)
export LD_LIBRARY_PATH="$CARRY/lib${NCCL_DIR:+:$NCCL_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NVLink multicast stays off in every process started from here (shared hosts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if [ ! -x "$BIN/cuda_attention_test" ]; then
  echo "missing $BIN: run 'bash tests/gpu/package.sh' on the CPU machine and carry .gpu-carry"
  exit 2
fi

declare -a SUMMARY=()
FAILED=0
step() {  # step NAME LOG cmd...
  local name=$1 log=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$log"
  "$@" >>"$log" 2>&1
  local rc=$?
  local status=PASS
  [ $rc -eq 0 ] || { status="FAIL(rc=$rc)"; FAILED=1; }
  SUMMARY+=("$(printf '%-34s %-12s %5ds' "$name" "$status" $((SECONDS - t0)))")
  tail -n 25 "$log" | grep -E "PASSED|FAILED|ERROR SUMMARY|worst|error|Error" | tail -n 8
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  uname -r
  cat "$CARRY/ptxas.txt" 2>/dev/null
  for b in "$BIN"/*; do cuobjdump --dump-resource-usage "$b" 2>/dev/null | grep -E "Function|REG" |
    sed 's/_ZN6kvpool4cuda8internal//'; done
} >"$OUT/resources.txt" 2>&1

# kvpoold itself under compute-sanitizer memcheck, for the integration tests to start: prints
# the wrapper's path (a failed check makes the wrapper's exit status, and so the suite's teardown,
# fail).
memcheck_wrapper() {
  # compute-sanitizer does not pass SIGTERM on: the wrapper does, and exits 0 only on a clean
  # memcheck summary.
  local SAN=$OUT/kvpoold-memcheck.sh
  cat >"$SAN" <<EOS
#!/bin/bash
log=\$(mktemp)
compute-sanitizer --print-limit 20 --tool memcheck --log-file "\$log" $BIN/kvpoold "\$@" &
cs=\$!
trap 'pkill -TERM -P \$cs' TERM INT
wait \$cs
[ \$? -gt 128 ] && wait \$cs
cat "\$log" >&2
# kvpoold's own exit status does not survive the sanitizer; its verdict does.
grep -q "ERROR SUMMARY: 0 errors" "\$log"
EOS
  chmod +x "$SAN"
  echo "$SAN"
}

SLOW='*Batch32At128K*'
if [ "$MODE" = all ] || [ "$MODE" = test ] || [ "$MODE" = quick ]; then
  step "codec test (GPU vs CPU, bit-exact)" "$OUT/test.log" "$BIN/cuda_codec_test" --gtest_color=no
  step "page checksums (GPU vs CPU)" "$OUT/test.log" "$BIN/page_checksum_cuda_test" --gtest_color=no
  step "batched device copies" "$OUT/test.log" "$BIN/copy_ranges_cuda_test" --gtest_color=no
  if [ "$MODE" = quick ]; then
    step "attention test (fast cases)" "$OUT/test.log" "$BIN/cuda_attention_test" \
      --gtest_color=no --gtest_filter="-$SLOW"
  else
    step "attention test (all, batch 32 x 128K)" "$OUT/test.log" "$BIN/cuda_attention_test" \
      --gtest_color=no
  fi
  # The engine attention backend (kernels/capi, docs/attention-backend.md): the C API's device
  # path against cuda::DecodeAttention (bit for bit) and its host path, then the Python entry
  # point on torch CUDA tensors.
  step "attention C API (device = kernel, bit-exact)" "$OUT/test.log" \
    "$BIN/attention_c_api_cuda_test" --gtest_color=no
  KVPOOL_ATTENTION_LIB=$CARRY/lib/libkvpool_attention.so step \
    "attention backend (Python, torch CUDA)" "$OUT/test.log" \
    python3 client/python/tests/test_attention_backend_cuda.py
  # A poisoned CUDA context (kvpoold-fault-injection's PoisonDevice on cuda:0): NOT_SERVING,
  # UNAVAILABLE, the failure in GetStats, exit status 3.
  KVPOOL_FAULT_INJECTION_DAEMON=$BIN/kvpoold-fault-injection step \
    "device health: poisoned context (cuda:0)" "$OUT/test.log" \
    "$BIN/integration_device_health_test" --gtest_color=no
  # The page checksums the arrival and demotion kernels fuse in, verified by reads and the
  # scrubber of a daemon on cuda:0.
  KVPOOL_FAULT_INJECTION_DAEMON=$BIN/kvpoold-fault-injection KVPOOL_TEST_DEVICE=cuda:0 step \
    "fused checksums verify (cuda:0)" "$OUT/test.log" "$BIN/integration_integrity_test" \
    --gtest_color=no --gtest_filter='*OnTheGpu*'
fi
if [ "$MODE" = all ] || [ "$MODE" = sanitize ]; then
  CS="compute-sanitizer --error-exitcode 9 --print-limit 20"
  step "memcheck codec test" "$OUT/sanitize.log" $CS --tool memcheck "$BIN/cuda_codec_test" \
    --gtest_color=no
  step "memcheck attention test" "$OUT/sanitize.log" $CS --tool memcheck \
    "$BIN/cuda_attention_test" --gtest_color=no --gtest_filter="-$SLOW:*OneHot*"
  step "racecheck attention test" "$OUT/sanitize.log" $CS --tool racecheck \
    "$BIN/cuda_attention_test" --gtest_color=no --gtest_filter="*MixedBatch*:*Group16And*:*Empty*:*OrdinaryLoads*:*TailMerge*:*TiersInSequence*"
  step "racecheck codec test" "$OUT/sanitize.log" $CS --tool racecheck "$BIN/cuda_codec_test" \
    --gtest_color=no --gtest_filter="*Int2Head128*:*LloydMax*"
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ] || [ "$MODE" = quick ]; then
  QUICK=""
  [ "$MODE" = quick ] && QUICK="--quick"
  step "benchmark (ours, byte floor)" "$OUT/bench.log" "$BIN/kvpool-gpu-bench" \
    --out "$OUT/gpu-kernels.json" $QUICK
  step "benchmark (attention while scrubbing)" "$OUT/bench.log" "$BIN/kvpool-gpu-bench" \
    --skip-codec --scrub_cost --model llama70b --batch 8 --batch 32 --context 32768 \
    --context 131072 --out "$OUT/gpu-scrub-cost.json"
  step "benchmark (torch SDPA BF16)" "$OUT/bench.log" python3 tests/gpu/sdpa_bench.py \
    --ours "$OUT/gpu-kernels.json" --out "$OUT/gpu.json"
  cp "$OUT/gpu.json" bench-results/gpu.json 2>/dev/null
  echo
  sed -n '/^device /,$p' "$OUT/bench.log" | tail -n 80
fi
if [ "$MODE" = all ] || [ "$MODE" = daemon ] || [ "$MODE" = daemon-quick ]; then
  # The CPU daemon's integration suite, unchanged, against kvpoold --device=cuda:0.
  export KVPOOL_TEST_DEVICE=cuda:0 KVPOOL_KVPOOLD=$BIN/kvpoold KVPOOL_CLI=$BIN/kvpool
  export UCX_TLS=${UCX_TLS:-posix,sysv,self,tcp}
  for t in roundtrip attention prefix concurrency bad_input cli device_transport \
      incremental_fetch; do
    step "conformance $t (cuda:0)" "$OUT/daemon.log" "$BIN/integration_${t}_test" --gtest_color=no
  done
  # CUDA IPC end to end: this test process pushes from its GPU memory into kvpoold on the same
  # GPU (two processes), checked bit for bit against the same K/V over gRPC.
  step "CUDA IPC push, two processes (cuda:0)" "$OUT/daemon.log" \
    "$BIN/integration_cuda_ipc_test" --gtest_color=no
  # Incremental fetch into this test process's GPU mirror arena: kvpoold copies the new blocks
  # and rows over CUDA IPC (FetchToDevice), checked against a full ReadBlocks after each fetch.
  step "incremental fetch into a worker's GPU arena (cuda:0)" "$OUT/daemon.log" \
    "$BIN/integration_device_fetch_test" --gtest_color=no
  SAN=$(memcheck_wrapper)
  for t in roundtrip attention; do
    KVPOOL_KVPOOLD=$SAN step "memcheck kvpoold: $t (cuda:0)" "$OUT/daemon.log" \
      "$BIN/integration_${t}_test" --gtest_color=no
  done
  unset KVPOOL_TEST_DEVICE
  QUICK=""
  [ "$MODE" = daemon-quick ] && QUICK="--quick"
  step "GPU daemon benchmark" "$OUT/daemon.log" "$BIN/kvpool-gpu-daemon-bench" \
    --kvpoold "$BIN/kvpoold" --device cuda:0 --out "$OUT/gpu-daemon.json" $QUICK
  cp "$OUT/gpu-daemon.json" bench-results/gpu-daemon.json 2>/dev/null
  echo
  sed -n '/^gpu-daemon benchmark/,$p' "$OUT/daemon.log" | head -n 40
fi
if [ "$MODE" = transport ]; then
  nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
  step "GPU data plane (NCCL, CUDA IPC)" "$OUT/transport.log" "$BIN/kvpool-gpu-transport-bench" \
    --kvpoold "$BIN/kvpoold" --out "$OUT/gpu-transport.json"
  step "fault: prefill killed mid-transfer" "$OUT/transport.log" \
    "$BIN/kvpool-gpu-transport-bench" --kvpoold "$BIN/kvpoold" --fault
  # Per-chunk timelines of each push (kvpoold's KVPOOL_TRACE_GPU_PUSH), quick sizes, own log.
  step "push timelines (quick, traced)" "$OUT/transport-trace.log" \
    "$BIN/kvpool-gpu-transport-bench" --kvpoold "$BIN/kvpoold" --quick --trace \
    --out "$OUT/gpu-transport-trace.json"
  cp "$OUT/gpu-transport.json" bench-results/gpu-transport.json 2>/dev/null
  echo
  grep -E "^check|^fault" "$OUT/transport.log"
  sed -n '/^gpu-transport benchmark/,$p' "$OUT/transport.log" | head -n 40
fi
if [ "$MODE" = ab ]; then
  # Same-machine A/B against a base bundle (.gpu-carry-base/bundle.tar.xz, packed from the commit
  # to compare against: kvpool-gpu-bench, kvpoold, kvpool-gpu-daemon-bench): the kernel benchmark
  # (decode attention, arrival, dequantize, demotion) and the GPU daemon's benchmark (remote
  # attention round trip, ingest), AB_ROUNDS (2) rounds each, interleaved, plus this bundle's
  # kernels under each variant of AB_VARIANTS. tests/gpu/ab_summary.py prints, per row, the mean
  # of each, the slowdown against the base and the spread of repeated runs of the same binary.
  # A variant is one or more tuning flags of kvpool-gpu-bench joined by commas
  # (kernels/cuda/kernel_tuning.h), variants separated by spaces, e.g.
  #   AB_VARIANTS="--tail_merge=never --programmatic_launch=0,--tiers_beside_history=0"
  BASE=${TMPDIR:-/tmp}/kvpool-gpu-base
  rm -rf "$BASE" && mkdir -p "$BASE" && tar -C "$BASE" -xJf .gpu-carry-base/bundle.tar.xz
  ROUNDS=$(seq 1 "${AB_ROUNDS:-2}")
  tag_of() {  # file-name tag of a variant: --a=1,--b=0 -> a=1+b=0
    printf '%s' "$1" | sed -e 's/^--//' -e 's/,--/+/g' -e 's/[^A-Za-z0-9_.=+-]/_/g'
  }
  TAGS=()
  for v in ${AB_VARIANTS:-}; do TAGS+=("$(tag_of "$v")"); done
  BASE_ENV=(env LD_LIBRARY_PATH="$BASE/lib:$LD_LIBRARY_PATH")
  for r in $ROUNDS; do
    step "kernels new ($r)" "$OUT/ab.log" "$BIN/kvpool-gpu-bench" --out "$OUT/ab-kernels-new-$r.json"
    step "kernels base ($r)" "$OUT/ab.log" "${BASE_ENV[@]}" "$BASE/bin/kvpool-gpu-bench" \
      --out "$OUT/ab-kernels-base-$r.json"
    step "daemon new ($r)" "$OUT/ab.log" "$BIN/kvpool-gpu-daemon-bench" --kvpoold "$BIN/kvpoold" \
      --device cuda:0 --quick --out "$OUT/ab-daemon-new-$r.json"
    step "daemon base ($r)" "$OUT/ab.log" "${BASE_ENV[@]}" "$BASE/bin/kvpool-gpu-daemon-bench" \
      --kvpoold "$BASE/bin/kvpoold" --device cuda:0 --quick --out "$OUT/ab-daemon-base-$r.json"
    for v in ${AB_VARIANTS:-}; do
      # shellcheck disable=SC2086
      step "kernels $v ($r)" "$OUT/ab.log" "$BIN/kvpool-gpu-bench" --skip-codec ${v//,/ } \
        --out "$OUT/ab-kernels-$(tag_of "$v")-$r.json"
    done
  done
  python3 tests/gpu/ab_summary.py "$OUT" "${AB_ROUNDS:-2}" ab-kernels base new "${TAGS[@]}" \
    | tee "$OUT/ab-kernels.txt"
  python3 tests/gpu/ab_summary.py "$OUT" "${AB_ROUNDS:-2}" ab-daemon base new \
    | tee "$OUT/ab-daemon.txt"
fi
if [ "$MODE" = profile ]; then
  # Nsight Compute on one decode step's kernels at each shape of PROFILE_SHAPES (model:batch:ctx,
  # space separated), clocks left alone: per-kernel details (speed of light, warp states,
  # scheduler, occupancy, memory) and the INT2 history kernel's per-instruction stall samples.
  KERNELS='regex:RotateQueries|Bf16Tier|Int2History|Merge'
  for shape in ${PROFILE_SHAPES:-llama70b:32:131072 llama70b:8:32768 llama70b:1:131072 smollm2:8:32768}; do
    IFS=: read -r model batch ctx <<<"$shape"
    rep=$OUT/prof${PROFILE_TAG:+-$PROFILE_TAG}-$model-$batch-$ctx
    step "ncu $shape" "$OUT/profile.log" ncu --clock-control none -k "$KERNELS" -s 40 -c 4 \
      --set full -f -o "$rep" "$BIN/kvpool-gpu-bench" --skip-codec --model "$model" \
      --batch "$batch" --context "$ctx" --out /tmp/prof.json
    ncu -i "$rep.ncu-rep" --page details --csv >"$rep-details.csv" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass -k regex:Int2History \
      >"$rep-source.csv" 2>&1
    rm -f "$rep.ncu-rep"
  done
  (cd "$OUT" && tar -cJf "profile${PROFILE_TAG:+-$PROFILE_TAG}-csv.tar.xz" prof-*.csv &&
    rm -f prof-*.csv)
fi
if [ "$MODE" = transport ] || [ "$MODE" = attention ]; then
  # Remote attention over a persistent NCCL channel (decode worker on GPU 0, kvpoold on GPU 1)
  # beside the gRPC API and the kernel alone, after its NCCL-vs-gRPC checks.
  step "remote attention over NCCL" "$OUT/attention.log" "$BIN/kvpool-gpu-attention-bench" \
    --kvpoold "$BIN/kvpoold" --out "$OUT/gpu-attention.json"
  step "fault: decode worker killed mid-call" "$OUT/attention.log" \
    "$BIN/kvpool-gpu-attention-bench" --kvpoold "$BIN/kvpoold" --fault
  cp "$OUT/gpu-attention.json" bench-results/gpu-attention.json 2>/dev/null
  echo
  grep -E "^check|^fault" "$OUT/attention.log"
  sed -n '/^  context  batch/,/^target/p' "$OUT/attention.log"
fi
if [ "$MODE" = all ] || [ "$MODE" = decode-path ]; then
  # The decode critical path on one GPU. Correctness first: the same-host channel against a GPU
  # daemon (also under memcheck), the attention backend's C API and Python entry point, the
  # incremental fetch into a worker's GPU arena; then every path's latency beside the kernels
  # and SDPA BF16, each path first checked bit for bit against the gRPC answer.
  KVPOOL_TEST_DEVICE=cuda:0 KVPOOL_KVPOOLD=$BIN/kvpoold step \
    "same-host channel conformance (cuda:0)" "$OUT/decode-path.log" \
    "$BIN/integration_shm_attention_test" --gtest_color=no
  KVPOOL_TEST_DEVICE=cuda:0 KVPOOL_KVPOOLD=$(memcheck_wrapper) step \
    "memcheck kvpoold: same-host channel (cuda:0)" "$OUT/decode-path.log" \
    "$BIN/integration_shm_attention_test" --gtest_color=no
  step "attention C API (device = kernel, bit-exact)" "$OUT/decode-path.log" \
    "$BIN/attention_c_api_cuda_test" --gtest_color=no
  KVPOOL_ATTENTION_LIB=$CARRY/lib/libkvpool_attention.so step \
    "attention backend (Python, torch CUDA)" "$OUT/decode-path.log" \
    python3 client/python/tests/test_attention_backend_cuda.py
  KVPOOL_TEST_DEVICE=cuda:0 KVPOOL_KVPOOLD=$BIN/kvpoold step \
    "conformance incremental_fetch (cuda:0)" "$OUT/decode-path.log" \
    "$BIN/integration_incremental_fetch_test" --gtest_color=no
  step "batched device copies (the fetch's copy kernel)" "$OUT/decode-path.log" \
    "$BIN/copy_ranges_cuda_test" --gtest_color=no
  KVPOOL_TEST_DEVICE=cuda:0 KVPOOL_KVPOOLD=$BIN/kvpoold step \
    "incremental fetch into a worker's GPU arena (cuda:0)" "$OUT/decode-path.log" \
    "$BIN/integration_device_fetch_test" --gtest_color=no
  # Attention over gRPC against the CPU kernels' arithmetic (the backend's attention changed too).
  KVPOOL_TEST_DEVICE=cuda:0 KVPOOL_KVPOOLD=$BIN/kvpoold step \
    "conformance attention (cuda:0)" "$OUT/decode-path.log" \
    "$BIN/integration_attention_test" --gtest_color=no
  QUICK=""
  [ -n "${DECODE_PATH_QUICK:-}" ] && QUICK="--quick"
  step "decode path benchmark (paths, bit-exact)" "$OUT/decode-path.log" \
    "$BIN/kvpool-gpu-decode-path-bench" --kvpoold "$BIN/kvpoold" --device cuda:0 \
    --out "$OUT/decode-path-raw.json" $QUICK
  step "decode path table (+ SDPA BF16)" "$OUT/decode-path.log" python3 \
    tests/gpu/decode_path_table.py --raw "$OUT/decode-path-raw.json" \
    --out "$OUT/gpu_decode_path.json"
  cp "$OUT/gpu_decode_path.json" bench-results/gpu_decode_path.json 2>/dev/null
  echo
  sed -n '/^one layer, us/,$p' "$OUT/decode-path.log"
fi
if [ "$MODE" = split-replay ]; then
  # The SmolLM2 split replayed against kvpoold --device=cuda:0 (make gpu-replay-capture made
  # .gpu-replay/replay.safetensors on the CPU machine): every Attend output against the CPU
  # daemon's, beside each step's top-two logit margin; the outputs go to $OUT for
  # replay_tokens.py (tokens, on the CPU machine).
  CAPTURE=.gpu-replay/replay.safetensors
  [ -f "$CAPTURE" ] || [ ! -f "$CAPTURE.xz" ] || xz -dkf "$CAPTURE.xz"
  step "SmolLM2 split replay (cuda:0 vs CPU run)" "$OUT/split-replay.log" \
    "$BIN/kvpool-split-replay" --kvpoold "$BIN/kvpoold" --device cuda:0 --capture "$CAPTURE" \
    --rotation calibration/rotations/smollm2-135m-instruct.rotation.safetensors \
    --out "$OUT/split-replay-gpu.safetensors"
  cat "$OUT/split-replay.log"
fi
echo
echo "step                               status       time"
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
