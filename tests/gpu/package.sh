#!/usr/bin/env bash
# Builds the GPU binaries on THIS machine (Debian 12, nvcc 13, no GPU needed) and packs them
# with the shared libraries the GPU machine lacks (gRPC, protobuf, Abseil, UCX, OpenSSL, spdlog;
# it has none of them and runs Ubuntu 24.04, whose glibc and libstdc++ are newer than ours) into
# .gpu-carry/ (ignored by git), for tests/gpu/run.sh on the lent GPU machine:
#
#   bash tests/gpu/package.sh            # then: run with carry [".gpu-carry"]
#
# .gpu-carry/bundle.tar.xz holds bin/ (kernel tests and benchmark, the attention C API's device
# test, kvpoold and kvpoold-fault-injection, the kvpool CLI, the integration tests, the GPU daemon
# benchmark) and lib/ (libkvpool_attention.so, and every library ldd lists outside glibc and the
# compiler runtime); run.sh unpacks it and sets LD_LIBRARY_PATH. xz keeps the carry well under
# the 64 MiB a call may take (the size prints at the end).
#
# Built for x86-64-v3 (not -march=native) so the binaries run on the GPU host's CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu-carry}
JOBS=${JOBS:-1}
KERNEL_TARGETS="cuda_codec_test cuda_attention_test page_checksum_cuda_test copy_ranges_cuda_test kvpool-gpu-bench
  attention_c_api_cuda_test"
# Shared libraries of the project itself, carried in lib/ (the engine attention backend's).
LIBRARY_TARGETS="kvpool_attention_capi"
DAEMON_TARGETS="kvpoold kvpool_cli kvpool-gpu-daemon-bench integration_roundtrip_test
  integration_attention_test integration_prefix_test integration_concurrency_test
  integration_bad_input_test integration_cli_test integration_device_transport_test
  integration_cuda_ipc_test kvpoold-fault-injection integration_device_health_test
  integration_integrity_test integration_incremental_fetch_test integration_device_fetch_test
  kvpool-gpu-transport-bench
  kvpool-gpu-attention-bench kvpool-split-replay
  integration_shm_attention_test kvpool-gpu-decode-path-bench"

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVPOOL_NATIVE=OFF \
  -DKVPOOL_BUILD_SERVICE=ON >/dev/null
# shellcheck disable=SC2086
cmake --build "$BUILD" -j"$JOBS" --target $KERNEL_TARGETS $DAEMON_TARGETS $LIBRARY_TARGETS

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin" "$STAGE/lib"
for t in $KERNEL_TARGETS $DAEMON_TARGETS; do
  f=$(find "$BUILD/bin" "$BUILD/tests" -maxdepth 1 -type f -name "$t" | head -n 1)
  [ "$t" = kvpool_cli ] && f="$BUILD/bin/kvpool"
  cp "$f" "$STAGE/bin/"
done
cp "$BUILD/lib/libkvpool_attention.so" "$STAGE/lib/"
strip --strip-unneeded "$STAGE"/bin/* "$STAGE"/lib/libkvpool_attention.so 2>/dev/null || true
# Every shared library outside glibc and the compiler runtime (those exist, newer, there), and
# outside NCCL (218 MB; the GPU machine has it in the nvidia-nccl wheel: run.sh points there).
for b in "$STAGE"/bin/* "$STAGE"/lib/libkvpool_attention.so; do ldd "$b"; done |
  awk '/=> \// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|ld-linux-x86-64|libnccl)\.so' |
  while read -r lib; do cp -L "$lib" "$STAGE/lib/"; done

# Register and spill report of every kernel (ptxas), for the closing note.
{
  for cu in kernels/cuda/*.cu; do
    cmd=$(python3 - "$BUILD/compile_commands.json" "$cu" <<'PY'
import json, sys
for c in json.load(open(sys.argv[1])):
    if c["file"].endswith(sys.argv[2]):
        print(c["command"]); break
PY
)
    [ -n "$cmd" ] || continue
    eval "$cmd -Xptxas -v -o /tmp/kvpool-ptxas.o" 2>&1 | grep -E "Compiling entry|registers|spill" |
      sed -e 's/ptxas info *: //' -e 's/_ZN6kvpool4cuda8internal//'
  done
} > "$STAGE/ptxas.txt" || true

rm -rf .gpu-carry
mkdir -p .gpu-carry
du -sh "$STAGE"
tar -C "$STAGE" -cf - bin lib ptxas.txt | xz -T0 -6 > .gpu-carry/bundle.tar.xz
EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qx '/.gpu-carry/' "$EXCLUDE" 2>/dev/null || echo '/.gpu-carry/' >>"$EXCLUDE"
du -sh .gpu-carry/bundle.tar.xz
