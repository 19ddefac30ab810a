#!/usr/bin/env bash
# The README's main command (`make demo`): set up, then run the tiny example end to end:
#   train a tiny Llama with FSDP2 on 2 CPU ranks (gloo)  ->  sharded DCP checkpoints
#   merge the latest checkpoint into a Hugging Face model directory
#   load it with plain transformers and print a short greedy generation
# Everything is local (the base model and data ship in examples/tiny-llama/). About a minute on
# 2 cores once the virtualenv exists. Outputs go to $DEMO_OUT (default outputs/), replaced on
# every run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cicd/setup.sh
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${DEMO_OUT:-outputs}
CFG=examples/tiny-llama.yml
TRAINED="$OUT/tiny-llama"
MERGED="$OUT/tiny-llama-merged"
rm -rf "$TRAINED" "$MERGED"
start=$SECONDS

echo "== 1/3 train: $CFG on 2 CPU ranks"
shardforge train "$CFG" --nproc_per_node 2 --output_dir "$TRAINED"

echo "== 2/3 merge: the latest checkpoint in $TRAINED -> $MERGED"
shardforge merge-sharded-fsdp-weights "$CFG" --output_dir "$TRAINED" --output_path "$MERGED" --verify

echo "== 3/3 load $MERGED with transformers and generate"
python examples/generate.py "$MERGED" --prompt "The robot" --max_new_tokens 24
echo "== demo done in $((SECONDS - start)) s"
