#!/usr/bin/env bash
# Writes the FileDescriptorSet of kvpool's API (proto/kvpool/v1/*.proto with their imports, no
# source info, so it stays small) to OUT. At release time, `make wire-baseline` writes it over
# tests/wire_compat/kvpool_v1_baseline.binpb: the release becomes the "previous release" that
# tests/wire_compat/ checks later protos against (docs/operations.md, "Versions and wire
# compatibility"). The test also runs it to describe the protos as they are now.
#
#   scripts/wire-compat-baseline.sh [OUT]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/tests/wire_compat/kvpool_v1_baseline.binpb}"
protoc="${PROTOC:-protoc}"
cd "$root/proto"
mapfile -t protos < <(ls kvpool/v1/*.proto | LC_ALL=C sort)
"$protoc" -I . --include_imports --descriptor_set_out="$out" "${protos[@]}"
