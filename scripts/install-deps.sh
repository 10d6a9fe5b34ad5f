#!/usr/bin/env bash
# Installs the Debian packages kvpool builds against, or the packages named as arguments (e.g.
# `make fuzz`'s clang). Idempotent: does nothing (not even `apt-get update`) when every package is
# already present, so `make` stays fast.
#
#   scripts/install-deps.sh                  # what the build and `make test` need
#   scripts/install-deps.sh clang-14 ...     # these instead
set -euo pipefail

BUILD_PACKAGES=(
  build-essential cmake pkg-config git python3 python3-venv
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  golang-github-gogo-googleapis-dev
  libabsl-dev libucx-dev ucx-utils
  libgtest-dev libgmock-dev libbenchmark-dev libc-ares-dev
  nlohmann-json3-dev libeigen3-dev liblapacke-dev libopenblas-dev libssl-dev libspdlog-dev
  openssl libcpp-httplib-dev
  clang-format
)
if [ "$#" -gt 0 ]; then PACKAGES=("$@"); else PACKAGES=("${BUILD_PACKAGES[@]}"); fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
