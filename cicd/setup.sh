#!/usr/bin/env bash
# Create or reuse the virtualenv in $VENV (default .venv) and install shardforge with its tested
# dependencies. torch goes first, from the constraints file, so pip takes the pinned build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
stamp="$VENV/.shardforge-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt cicd/constraints.txt ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -c cicd/constraints.txt torch
"$VENV/bin/python" -m pip install -q -c cicd/constraints.txt -e '.[dev]'
touch "$stamp"
