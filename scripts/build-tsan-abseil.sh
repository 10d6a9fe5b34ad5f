#!/usr/bin/env bash
# Builds the installed Debian Abseil again, from its own Debian source, with ThreadSanitizer, into
# OUT_DIR/lib (shared libraries with the same sonames), for `make sanitize`'s TSan run:
#
#   scripts/build-tsan-abseil.sh build-tsan/abseil-tsan
#   LD_LIBRARY_PATH=build-tsan/abseil-tsan/lib build-tsan/tests/server_test
#
# Why: absl::Mutex locks in code ThreadSanitizer does not see, so with Debian's uninstrumented
# library every access guarded by an absl::Mutex (kvpool's and gRPC's) would be reported as a
# race. The instrumented build carries Abseil's own TSan annotations. Same version, same Debian
# patches (soname, inline namespace, options.h), so it replaces the system copy at run time.
#
# Idempotent: does nothing when OUT_DIR/lib/.complete exists. Needs the network once (apt's
# source index and the source package, fetched with a private apt state under OUT_DIR; the
# system's apt configuration is not touched).
set -euo pipefail

out=$(realpath -m "${1:?usage: build-tsan-abseil.sh OUT_DIR}")
jobs=${JOBS:-2}
if [ -f "$out/lib/.complete" ]; then
  exit 0
fi

version=$(dpkg-query -W -f='${Version}' libabsl-dev)
codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
work=$out/work
rm -rf "$work"
mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/src"
cat > "$work/apt/sources.list" <<EOF
deb-src http://deb.debian.org/debian $codename main
deb-src http://deb.debian.org/debian $codename-updates main
deb-src http://deb.debian.org/debian-security $codename-security main
EOF
apt_opts=(-o "Dir::Etc::SourceList=$work/apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache"
          -o "APT::Sandbox::User=root")
echo "build-tsan-abseil: fetching the source of abseil $version"
apt-get "${apt_opts[@]}" -qq update
(cd "$work/src" && apt-get "${apt_opts[@]}" -qq source "abseil=$version")
src=$(find "$work/src" -maxdepth 1 -mindepth 1 -type d -name 'abseil-*' | head -1)
if [ -z "$src" ]; then
  echo "build-tsan-abseil: the source package did not unpack (is dpkg-dev installed?)" >&2
  exit 1
fi

# Debian's own configuration (debian/rules): C++17, shared libraries.
echo "build-tsan-abseil: building with -fsanitize=thread (a few minutes)"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_STANDARD=17 \
  -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF -DABSL_PROPAGATE_CXX_STD=ON \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" > "$work/configure.log"
cmake --build "$work/build" -j "$jobs" > "$work/build.log"

mkdir -p "$out/lib"
find "$work/build" -name 'libabsl_*.so*' -exec cp -P {} "$out/lib/" \;
touch "$out/lib/.complete"
rm -rf "$work"
echo "build-tsan-abseil: $(ls "$out/lib" | grep -c '\.so\.') libraries in $out/lib"
