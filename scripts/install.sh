#!/usr/bin/env bash
# Installs the project and its test dependencies, then writes the interpreter to use to build/python.
#
# The interpreter: an existing .venv in the repo; else $PY (python3) if it is a virtual environment or accepts
# pip installs; else a new .venv (python3 -m venv), made when $PY refuses installs (PEP 668
# "externally-managed-environment") or has no pip. The new .venv sees $PY's packages when $PY has torch >= 2.5
# (e.g. a CUDA build on a GPU machine), so that torch is kept. Without torch >= 2.5 it installs the CPU build
# torch==2.13.0 (a looser requirement would pull a multi-GB CUDA build).
set -euo pipefail
PY=${PY:-python3}
cd "$(dirname "$0")/.."
mkdir -p build

has_torch() {  # torch >= $2 (default 2.5) importable
  "$1" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(v < tuple(int(x) for x in sys.argv[1].split(".")))' "${2:-2.5}" 2>/dev/null
}
in_venv() {
  "$1" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null
}
accepts_installs() {  # has pip, and is not marked externally managed (PEP 668) unless the user overrides it
  "$1" -m pip --version >/dev/null 2>&1 || return 1
  case "${PIP_BREAK_SYSTEM_PACKAGES:-}" in 1 | [Tt]rue | [Yy]es | [Oo]n) return 0 ;; esac
  "$1" -c 'import os, sys, sysconfig
sys.exit(os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))' 2>/dev/null
}

if ! command -v "$PY" >/dev/null 2>&1; then
  echo "install: $PY not found; install Python >= 3.10 or pass PY=/path/to/python3" >&2
  exit 1
fi
if [ -x .venv/bin/python ] && ! in_venv "$PY"; then
  PY=.venv/bin/python
elif ! in_venv "$PY" && ! accepts_installs "$PY"; then
  venv_args=()
  if has_torch "$PY"; then
    venv_args=(--system-site-packages)
  fi
  echo "install: $PY refuses pip installs (externally managed, PEP 668) or has no pip;" \
    "installing into .venv${venv_args[*]:+ (${venv_args[*]})}" >&2
  if ! "$PY" -m venv "${venv_args[@]}" .venv; then
    rm -rf .venv
    echo "install: '$PY -m venv' failed; install the venv module (Debian/Ubuntu: apt-get install python3-venv)" \
      "or activate a virtual environment, then run make again" >&2
    exit 1
  fi
  PY=.venv/bin/python
fi
if ! has_torch "$PY"; then
  "$PY" -m pip install -q torch==2.13.0
fi
# transformers >= 5 needs torch >= 2.6: on torch 2.5 it imports with its models disabled, so keep 4.x there
"$PY" -m pip install -q -e ".[test]" $(has_torch "$PY" 2.6 || echo "transformers>=4.45,<5")
"$PY" -c 'import sys; print(sys.executable)' > build/python
echo "install: done; using $(cat build/python)" >&2
