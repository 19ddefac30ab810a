#!/usr/bin/env bash
# GPU check for a machine with NVIDIA GPUs (not part of `make test`): NCCL, bf16, FSDP2 training
# on every GPU, resume at another world size, merge, load and generate.
#   bash cicd/gpu_test.sh            # uses all GPUs (at least 1; 2+ exercises NCCL collectives)
# Exit status 0 only when every step passed. Outputs go to $GPU_TEST_OUT (default outputs/gpu-test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash cicd/setup.sh
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${GPU_TEST_OUT:-outputs/gpu-test}
CFG=examples/tiny-llama.yml
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== 1/5 environment: CUDA, NCCL, bf16"
NGPU=$(python - <<'PY'
import torch, torch.distributed as dist
assert torch.cuda.is_available(), "no CUDA device visible to torch"
assert dist.is_nccl_available(), "this torch build has no NCCL"
assert torch.cuda.is_bf16_supported(), "this GPU does not support bf16"
n = torch.cuda.device_count()
import sys
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {torch.cuda.nccl.version()}, "
      f"{n} x {torch.cuda.get_device_name(0)}", file=sys.stderr)
print(n)
PY
)

echo "== 2/5 NCCL all-reduce on $NGPU rank(s)"
cat > "$OUT/nccl_check.py" <<'PY'
import os, torch, torch.distributed as dist
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
x = torch.full((1024,), float(rank + 1), device="cuda", dtype=torch.bfloat16)
dist.all_reduce(x)
assert torch.all(x == world * (world + 1) / 2), x[:4]
dist.destroy_process_group()
PY
python -m torch.distributed.run --standalone --nproc_per_node "$NGPU" "$OUT/nccl_check.py"

echo "== 3/5 bf16 FSDP2 training on $NGPU GPU(s), 40 steps, stopped at step 20"
shardforge train "$CFG" --output_dir "$OUT/train" --bf16 true --max_steps 40 --save_steps 20 \
  --fsdp.activation_checkpointing true --nproc_per_node "$NGPU"
rm -rf "$OUT/train/checkpoint-40"

echo "== 4/5 resume from checkpoint-20 on 1 GPU, same global batch (another world size if NGPU > 1)"
shardforge train "$CFG" --output_dir "$OUT/train" --bf16 true --max_steps 40 --save_steps 20 \
  --fsdp.activation_checkpointing true --resume_from_checkpoint auto --nproc_per_node 1 \
  --micro_batch_size $((4 * NGPU)) --gradient_accumulation_steps 1 2>&1 | tee "$OUT/resume.log"
grep -q "at step 20" "$OUT/resume.log"

echo "== 5/5 merge, load, generate"
shardforge merge-sharded-fsdp-weights "$CFG" --output_dir "$OUT/train" --output_path "$OUT/merged"
python examples/generate.py "$OUT/merged" --prompt "The robot" --max_new_tokens 16
echo "== GPU test passed"
