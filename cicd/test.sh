#!/usr/bin/env bash
# The test command (README: `make test`): set up, lint, type-check, run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cicd/setup.sh
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# one intra-op thread per process: 2 test workers and the ranks they start already fill the
# cores, and torch's own threads on top of them only contend (the suite ran 9:06 -> 8:28)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ruff check src tests benchmarks
ruff format --check src tests benchmarks
mypy
lint-imports --no-logo
pytest -q -n 2 --dist loadfile "$@"
