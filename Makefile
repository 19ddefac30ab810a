.PHONY: setup demo test lint format

setup:
	bash cicd/setup.sh

# Train the tiny example with FSDP on 2 CPU ranks, merge it, load it and generate.
demo:
	bash cicd/demo.sh

# Lint, type-check and run the test suite (installs everything first).
test:
	bash cicd/test.sh

lint:
	bash cicd/setup.sh && .venv/bin/ruff check src tests benchmarks && .venv/bin/mypy

format:
	bash cicd/setup.sh && .venv/bin/ruff format src tests benchmarks && .venv/bin/ruff check --fix src tests benchmarks
