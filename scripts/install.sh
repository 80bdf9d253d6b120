#!/usr/bin/env bash
# Installs the project and its test dependencies into the current python3. Keeps an existing torch (>= 2.5,
# e.g. a CUDA build on a GPU machine); without one, installs the CPU build 2.13.0 (a looser requirement
# would pull a multi-GB CUDA build).
set -euo pipefail
PY=${PY:-python3}
cd "$(dirname "$0")/.."
if ! $PY -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split(".")[:2]); sys.exit(v < (2, 5))' 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e ".[test]"
