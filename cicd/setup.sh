#!/usr/bin/env bash
# Create or reuse the virtualenv in $VENV (default .venv) and install shardforge with its tested
# dependencies. torch goes first, from the constraints file, so pip takes the pinned build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# Debian's chromium and its driver: the chat page's test opens it in a real headless browser
# (tests/use/test_gradio_page.py); only where apt-get can run as root, else that test is skipped
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "setup: chromium/chromedriver missing and apt-get cannot run here (not root or not" \
      "Debian): tests/use/test_gradio_page.py will be skipped" >&2
  fi
fi
stamp="$VENV/.shardforge-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt cicd/constraints.txt ]; then
  exit 0
fi
echo "setup: installing shardforge and its tested dependencies into $VENV (a few minutes the first time; later runs reuse it)" >&2
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "setup: 1/3 torch (cicd/constraints.txt)" >&2
"$VENV/bin/python" -m pip install -q -c cicd/constraints.txt torch
echo "setup: 2/3 shardforge and its dependencies (.[dev])" >&2
"$VENV/bin/python" -m pip install -q -c cicd/constraints.txt -e '.[dev]'
echo "setup: 3/3 torchtitan (its parity test)" >&2
# torchtitan for its parity test, without its requirements: it pins datasets<4.8 and asks for
# torchdata and torch_checkpointing, which the model code the test imports does not use (its
# imports tyro and einops come with the dev extra)
"$VENV/bin/python" -m pip install -q --no-deps -c cicd/constraints.txt torchtitan spmd_types
touch "$stamp"
