#!/usr/bin/env bash
# Determinism of kvpool-calibrate on real captures: a second run gives the same file, byte for
# byte (same rotations, statistics and codec version).
#
#   smoke_determinism.sh KVPOOL_CALIBRATE CAPTURES_DIR FIRST_FILE [FLAGS...]
set -euo pipefail
bin="$1" captures="$2" first="$3"
shift 3
second="${first%.safetensors}.again.safetensors"
"$bin" --captures="$captures" --out="$second" --quiet "$@" >/dev/null
if cmp -s "$first" "$second"; then
  echo "deterministic: $first == $second"
else
  echo "FAIL: $first and $second differ"
  exit 1
fi
