#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries on THIS machine (Debian 12, nvcc 13, no GPU needed)
# and collects them with the shared libraries they need that the GPU machine lacks (Abseil)
# into .gpu-carry/ (ignored by git), for tests/gpu/run.sh on the lent GPU machine.
#
#   bash tests/gpu/package.sh            # then: run with carry [".gpu-carry"]
#
# Built for x86-64-v3 (not -march=native) so the binaries run on the GPU host's CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu-carry}
JOBS=${JOBS:-1}
TARGETS="cuda_codec_test cuda_attention_test kvpool-gpu-bench"

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVPOOL_NATIVE=OFF \
  -DKVPOOL_BUILD_SERVICE=OFF >/dev/null
# shellcheck disable=SC2086
cmake --build "$BUILD" -j"$JOBS" --target $TARGETS

rm -rf .gpu-carry
mkdir -p .gpu-carry/bin .gpu-carry/lib
cp "$BUILD/tests/cuda_codec_test" "$BUILD/tests/cuda_attention_test" \
  "$BUILD/bin/kvpool-gpu-bench" .gpu-carry/bin/
# Every shared library outside glibc and the compiler runtime (those exist, newer, there).
for b in .gpu-carry/bin/*; do ldd "$b"; done | awk '/=> \// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|ld-linux-x86-64)\.so' |
  while read -r lib; do cp -L "$lib" .gpu-carry/lib/; done

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
} > .gpu-carry/ptxas.txt || true

grep -qx '/.gpu-carry/' .git/info/exclude 2>/dev/null || echo '/.gpu-carry/' >> .git/info/exclude
du -sh .gpu-carry
ls .gpu-carry/bin .gpu-carry/lib | head -50
