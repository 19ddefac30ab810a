"""merge-lora benchmark: shardforge's streaming fuse against peft's in-memory merge.

Makes (or takes) a Llama-shaped base model of a chosen size, saved in float32 safetensors, and a
LoRA adapter on every linear layer of its decoder (random A and B, saved by peft), then
measures, alternating the contenders run by run:

- shardforge: `shardforge merge-lora CFG --lora_model_dir AD --output_path OUT`
- peft: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), AD)
  .merge_and_unload().to(DTYPE).save_pretrained(OUT)`
- imports: a process that only imports torch, transformers and shardforge's merge-lora and
  builds the architecture on the meta device (the floor under shardforge's peak RSS: what is
  left above it is the merge's own memory)

Each contender runs in its own process, started from a small launcher that takes the peak RSS
(`ru_maxrss`) of the child. The script prints the medians of the wall time and peak RSS, the
largest tensor of the model (what "about one tensor" means here), whether the cache was warm or
cold, and whether the two outputs hold the same tensors (bit for bit in float32).

    python benchmarks/lora_bench.py --size 600MB --repeats 3
    python benchmarks/lora_bench.py --size 600MB --repeats 3 --dtype bfloat16
    python benchmarks/lora_bench.py --base path/to/model --adapter path/to/adapter --cache warm
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

# the test helpers (tiny models, CPU ranks) live in tests/helpers/, outside the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# the merge benchmark's helpers (this directory is on sys.path when the script runs)
from merge_bench import evict, human, parse_size, run_one, warm

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_config_for(size_bytes: int) -> dict[str, Any]:
    """hidden 1024, vocab 32000, as many layers as the float32 size asks for."""
    hidden, inter, vocab, heads, kv = 1024, 2816, 32000, 16, 4
    head_dim = hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((size_bytes / 4 - fixed) / per_layer))
    return {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }


def make_inputs(root: Path, size_bytes: int, rank: int) -> tuple[Path, Path]:
    """A float32 base model (config, safetensors, tokenizer) and a LoRA adapter on it."""
    import torch
    from peft import LoraConfig, get_peft_model

    from helpers.tiny import make_model

    base, adapter = root / "base", root / "adapter"
    ready = [base / "config.json", adapter / "adapter_config.json", root / "run" / "checkpoint-1"]
    if all(p.exists() for p in ready):
        print(f"reusing {base} and {adapter}", file=sys.stderr)
        return base, adapter
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(adapter, ignore_errors=True)
    print(f"making a {human(size_bytes)} float32 base model in {base}", file=sys.stderr)
    make_model(base, "llama", vocab_size=32000, **llama_config_for(size_bytes))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS)
    peft_model = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # peft starts B at zeros: the fuse would change nothing
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    peft_model.save_pretrained(adapter)
    # the same weights as a PEFT-wrapped model's DCP checkpoint (as accelerate saves it under
    # FSDP), for the `checkpoint` contender: merge-sharded-fsdp-weights --merge_lora
    import torch.distributed.checkpoint as dcp

    step = root / "run" / "checkpoint-1"
    shutil.rmtree(step, ignore_errors=True)
    dcp.save(
        {"model": peft_model.state_dict()},
        checkpoint_id=step / "pytorch_model_fsdp_0",
        no_dist=True,
    )
    lora.save_pretrained(step)
    return base, adapter


PEFT = """
    import sys, torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, sys.argv[2]).merge_and_unload()
    merged.to(getattr(torch, sys.argv[4])).save_pretrained(sys.argv[3])
"""
IMPORTS = """
    import sys, torch, shardforge.merge.lora
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):  # the model code imported, as both merges import it
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
"""


def command_for(
    name: str, cfg: Path, base: Path, adapter: Path, out: Path, dtype: str
) -> list[str]:
    if name == "shardforge":
        shardforge = str(Path(sys.executable).parent / "shardforge")
        return [shardforge, "merge-lora", str(cfg), "--lora_model_dir", str(adapter),
                "--output_path", str(out), "--dtype", dtype, "--quiet",
                "--no_save_tokenizer"]  # fmt: skip
    if name == "checkpoint":  # a LoRA training checkpoint, fused by the sharded merge
        shardforge = str(Path(sys.executable).parent / "shardforge")
        return [shardforge, "merge-sharded-fsdp-weights", str(cfg), "--merge_lora",
                "--output_path", str(out), "--dtype", dtype, "--quiet",
                "--no_save_tokenizer"]  # fmt: skip
    if name == "peft":
        code = textwrap.dedent(PEFT)
        return [sys.executable, "-c", code, str(base), str(adapter), str(out), dtype]
    return [sys.executable, "-c", textwrap.dedent(IMPORTS), str(base)]


def weights(directory: Path) -> dict[str, Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {k: directory / v for k, v in mapping.items()}
    from safetensors import safe_open

    path = directory / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        return dict.fromkeys(f.keys(), path)


def same_outputs(a: Path, b: Path) -> str:
    """Compare two outputs tensor by tensor (one tensor in memory at a time)."""
    import torch
    from safetensors import safe_open

    wa, wb = weights(a), weights(b)
    if set(wa) != set(wb):
        return f"no: different names ({len(set(wa) ^ set(wb))} differ)"
    differ = []
    for name in sorted(wa):
        with (
            safe_open(str(wa[name]), framework="pt") as fa,
            safe_open(str(wb[name]), framework="pt") as fb,
        ):
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                differ.append(name)
    return f"no: {len(differ)} tensors differ ({differ[:3]})" if differ else "yes, bit for bit"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="600MB", help="base model size (float32), e.g. 600MB")
    parser.add_argument("--rank", type=int, default=16, help="LoRA r of the made adapter")
    parser.add_argument("--base", default="", help="use this base model directory instead")
    parser.add_argument("--adapter", default="", help="use this adapter directory instead")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="output dtype (a cast makes every tensor go through memory)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contenders", default="shardforge,peft,imports")
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold")
    parser.add_argument("--workdir", default=".bench", help="where the inputs and outputs go")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    args = parser.parse_args()

    root = Path(args.workdir).resolve() / f"lora-{args.size}-r{args.rank}"
    root.mkdir(parents=True, exist_ok=True)
    if args.base and args.adapter:
        base, adapter = Path(args.base).resolve(), Path(args.adapter).resolve()
    else:
        base, adapter = make_inputs(root, parse_size(args.size), args.rank)
    cfg = root / "bench.yml"
    cfg.write_text(f"base_model: {base}\noutput_dir: {root / 'run'}\n")
    files = sorted(base.glob("*.safetensors")) + sorted(adapter.glob("*.safetensors"))
    files += sorted((root / "run").rglob("*.distcp"))
    base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    largest = largest_tensor(base)

    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    seconds: dict[str, list[float]] = {n: [] for n in names}
    rss: dict[str, list[int]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # alternate who goes first
        for name in order:
            out = root / f"merged-{name}"
            shutil.rmtree(out, ignore_errors=True)
            (evict if args.cache == "cold" else warm)(files)
            cmd = command_for(name, cfg, base, adapter, out, args.dtype)
            s, r, code, err = run_one(cmd, None, root)
            if code != 0:
                sys.exit(f"{name} failed (exit {code}):\n{err}")
            seconds[name].append(s)
            rss[name].append(r)
            print(f"  run {rep + 1} {name}: {s:.2f} s, peak RSS {human(r)}", file=sys.stderr)
    identical = (
        same_outputs(root / "merged-shardforge", root / "merged-peft")
        if {"shardforge", "peft"} <= set(names)
        else "not compared"
    )
    if {"shardforge", "checkpoint"} <= set(names):
        fused = same_outputs(root / "merged-shardforge", root / "merged-checkpoint")
        print(f"merge-lora vs merge-sharded-fsdp-weights --merge_lora outputs: {fused}")

    print(f"\nbase model: {human(base_bytes)} float32 ({base}); largest tensor {human(largest)}")
    print(f"adapter: {adapter}; output dtype: {args.dtype}; cache: {args.cache} "
          f"({'evicted' if args.cache == 'cold' else 'read once'} before every run); "
          f"repeats: {args.repeats}")  # fmt: skip
    print(f"{'contender':<14}{'median s':>10}{'runs s':>26}{'peak RSS':>12}{'RSS/base':>10}")
    table: dict[str, Any] = {"base_bytes": base_bytes, "largest_tensor": largest,
                             "dtype": args.dtype, "cache": args.cache, "results": {}}  # fmt: skip
    for name in names:
        med, peak = statistics.median(seconds[name]), statistics.median(rss[name])
        runs = ", ".join(f"{s:.2f}" for s in seconds[name])
        print(f"{name:<14}{med:>10.2f}{runs:>26}{human(peak):>12}{peak / base_bytes:>10.1%}")
        table["results"][name] = {"median_s": med, "runs_s": seconds[name], "peak_rss": peak}
    if "shardforge" in names and "imports" in names:
        extra = statistics.median(rss["shardforge"]) - statistics.median(rss["imports"])
        print(f"shardforge above the imports: {human(extra)} ({extra / largest:.2f}x the largest "
              "tensor)")  # fmt: skip
        table["shardforge_above_imports"] = extra
    if "shardforge" in names and "peft" in names:
        ratio = statistics.median(seconds["shardforge"]) / statistics.median(seconds["peft"])
        print(f"shardforge / peft: {ratio:.2f}x the time")
        table["time_ratio"] = ratio
    print(f"outputs identical: {identical}")
    table["identical"] = identical
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


def largest_tensor(base: Path) -> int:
    from safetensors import safe_open

    largest = 0
    for path in base.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sl = f.get_slice(name)
                n = 4 if sl.get_dtype() == "F32" else 2
                for d in sl.get_shape():
                    n *= d
                largest = max(largest, n)
    return largest


if __name__ == "__main__":
    main()
