#!/usr/bin/env bash
# The test command (README: `make test`): set up, lint, type-check, run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cicd/setup.sh
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check src tests benchmarks
ruff format --check src tests benchmarks
mypy
lint-imports --no-logo
pytest -q -n 2 --dist loadfile "$@"
