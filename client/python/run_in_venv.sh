#!/usr/bin/env bash
# CTest wrapper for the Python package's tests: skips (exit 77) when the project venv is absent
# (`make venv` creates it), otherwise runs the command.
#
#   run_in_venv.sh VENV_PYTHON COMMAND [ARGS...]
set -euo pipefail
py="$1"
shift
if [ ! -x "$py" ]; then
  echo "SKIP: needs the venv ($py); run 'make venv'"
  exit 77
fi
exec "$@"
