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
# three test workers on two cores: a worker waiting on a shared fixture another builds, or on a
# child process's start, leaves its core to the others (quiet 2-core machine: fca6e73 11:17;
# 3655ab8, the ranks forked from a preloaded process, 5:56)
# pytest's temporary folders (and the TMPDIR the suite's processes get, tests/conftest.py) in
# one folder of this run's, removed however the run ends: nothing is left in /tmp, not even the
# pytest-of-<user> folder pytest makes there by default
base=$(mktemp -d)
trap 'rm -rf "$base"' EXIT
pytest -q -n 3 --dist loadfile --basetemp "$base/pytest" "$@"
