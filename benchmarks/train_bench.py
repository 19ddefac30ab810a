"""Training throughput benchmark: tokens/s, MFU, peak memory per phase and compile time of
shardforge's own training step, variant by variant.

    python benchmarks/train_bench.py --preset llama-3.2-1b --sequence_len 2048 \\
        --micro_batch_size 4 --warmup 3 --steps 10
    python benchmarks/train_bench.py --preset llama-3.1-8b --micro_batch_size 1 \\
        --variants eager+varlen+ac,compile+varlen+chunked+ac
    python benchmarks/train_bench.py --preset tiny --warmup 1 --steps 2 --in_process   # CPU

A preset is a model shape (no download): `llama-3.2-1b`, `llama-3.1-8b`, `qwen3-0.6b` (the
published configs' shapes: vocabulary, hidden and MLP sizes, layers, heads, tied embeddings) or
`tiny`. The bench writes the preset's config.json, a small tokenizer (its ids index the full
vocabulary) and a packed completion data set under `--workdir`; the weights are random, drawn
on the device after sharding (`materialize_and_load` is the one part replaced: no checkpoint
file is read). Everything else is the product: the config is validated by `validate_cfg`, the
run set up by `train.loop.Trainer.setup` (model, FSDP2, packed attention, optimizer) and each
step is `Trainer.step` (`train.step.train_step`); nothing is saved.

A variant is `+`-joined options: `eager`/`compile` (config `torch_compile`), the attention
`sdpa` (as configured: with packing on a GPU shardforge switches it to a kernel without a dense
mask, see docs/train.md), `dense` (sdpa kept on transformers' dense mask by `sample_packing_keep_sdpa: true`: the baseline), `flex`
(flex_attention with the document BlockMask) or `varlen` (varlen_attention), `chunked`
(config `chunked_cross_entropy: true`; without it false) and `ac` (gradient_checkpointing).
`--set KEY=VALUE` adds a config key to every variant (`optimizer=adamw_torch_fused`,
`fsdp.offload_params=true`, ...).
A variant this stack cannot run is reported as skipped with the reason (a config key this
shardforge does not have yet, flex_attention's missing backward on CPU, no varlen_attn).

Each variant runs in a fresh process (world size 1; `--nproc N`: torchrun with N ranks), or,
with `--in_process`, in this one. Per variant: `--warmup` steps, then `--steps` measured ones.
Printed and written as JSON (`--json`): tokens/s (every position of the packed windows,
padding included, and the non-padding tokens), MFU, the median step time, the first step's
time and the compile time (first step minus the median, compile variants), peak memory of
setup and of the forward / backward / optimizer phases (CUDA max allocated on a GPU, the RSS
high-water mark on CPU), the losses.

MFU = tokens/s x FLOPs per token / (peak TFLOP/s x 1e12 x ranks), FLOPs per token =
6 N + 12 L H T (torchtitan's count): N the matmul parameters (every Linear, the output head
once when tied to the embedding), L layers, H = heads x head dim, T the sequence length.
Peak: 989 TFLOP/s (dense bf16, H100 SXM / H200), `--peak_tflops` for another.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import yaml

# the test helpers (tiny tokenizer, texts) live in tests/helpers/, outside the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PEAK_TFLOPS = 989.0  # dense bf16, H100 SXM and H200
MFU_FORMULA = (
    "MFU = tokens/s x FLOPs/token / (peak TFLOP/s x 1e12 x ranks); FLOPs/token = 6*N + 12*L*H*T "
    "(N matmul parameters, tied head once; L layers; H heads x head dim; T sequence length)"
)
_LLAMA = {"model_type": "llama", "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        **_LLAMA,
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        **_LLAMA,
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
    },
    "tiny": {
        **_LLAMA,
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
}
ATTENTION = {
    "sdpa": "sdpa",
    "dense": "sdpa",
    "flex": "flex_attention",
    "varlen": "varlen_attention",
}
DEFAULT_VARIANTS = (
    "eager+dense",
    "eager+flex",
    "eager+varlen",
    "compile+flex+chunked",
    "compile+varlen+chunked",
    "compile+varlen+chunked+ac",
)


class Variant(NamedTuple):
    compile: bool
    attention: str
    chunked: bool
    ac: bool

    @classmethod
    def parse(cls, name: str) -> Variant:
        parts = set(name.split("+"))
        attention = [p for p in parts if p in ATTENTION]
        unknown = parts - set(ATTENTION) - {"eager", "compile", "chunked", "ac"}
        if unknown or len(attention) > 1 or {"eager", "compile"} <= parts:
            raise SystemExit(
                f"error: variant {name!r}: options are eager|compile, "
                f"{'|'.join(ATTENTION)}, chunked, ac"
            )
        return cls(
            "compile" in parts, (attention or ["sdpa"])[0], "chunked" in parts, "ac" in parts
        )

    @property
    def name(self) -> str:
        parts = ["compile" if self.compile else "eager", self.attention]
        return "+".join(parts + ["chunked"] * self.chunked + ["ac"] * self.ac)


# -- FLOPs ---------------------------------------------------------------------------------------


def matmul_params(model: Any) -> int:
    """Weights of every Linear (the output head once when tied to the embedding)."""
    import torch

    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            seen[id(module.weight)] = module.weight.numel()
    return sum(seen.values())


def flops_per_token(n_matmul: int, layers: int, attn_width: int, seq_len: int) -> float:
    """torchtitan's count: 6 N + 12 L H T."""
    return 6.0 * n_matmul + 12.0 * layers * attn_width * seq_len


def mfu(tokens_per_s: float, flops: float, peak_tflops: float, ranks: int = 1) -> float:
    return tokens_per_s * flops / (peak_tflops * 1e12 * ranks)


def model_config(preset: str) -> Any:
    from transformers import AutoConfig

    kwargs = dict(PRESETS[preset])
    return AutoConfig.for_model(
        kwargs.pop("model_type"), bos_token_id=1, eos_token_id=2, pad_token_id=3, **kwargs
    )


def shape_facts(preset: str, seq_len: int) -> dict[str, Any]:
    """The preset's matmul parameters and FLOPs per token (counted on a meta-device model)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = matmul_params(model)
    width = config.num_attention_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    layers = config.num_hidden_layers
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "matmul_params": n,
        "layers": layers,
        "attn_width": width,
        "flops_per_token": flops_per_token(n, layers, width, seq_len),
    }


# -- inputs --------------------------------------------------------------------------------------


def prepare(workdir: Path, preset: str, tokens: int) -> tuple[Path, Path]:
    """The preset's model directory (config, tokenizer; no weights) and a completion data set
    of documents of varied length, at least `tokens` tokens."""
    from helpers.tiny import make_tokenizer, tiny_sentences, write_jsonl

    base = workdir / f"base-{preset}"
    base.mkdir(parents=True, exist_ok=True)
    model_config(preset).save_pretrained(base)
    tokenizer = make_tokenizer(320, seed=0)
    tokenizer.save_pretrained(base)
    rng = random.Random(0)
    sentences = tiny_sentences(4000, seed=0)
    rows, count = [], 0
    while count < tokens:
        text = " ".join(rng.choice(sentences) for _ in range(rng.randint(4, 160)))
        count += len(tokenizer(text)["input_ids"]) + 1
        rows.append({"text": text})
    data = write_jsonl(workdir / f"data-{tokens}.jsonl", rows)
    return base, data


def fields() -> set[str]:
    from shardforge.config.schema import ShardforgeConfig

    return set(ShardforgeConfig.model_fields)


def skip_reason(variant: Variant, device: str) -> str | None:
    """Why this stack cannot run the variant (None: it can)."""
    known = fields()
    if variant.compile and "torch_compile" not in known:
        return "not available: this shardforge has no torch_compile key (issue 30 item 1)"
    if variant.chunked and "chunked_cross_entropy" not in known:
        return "not available: this shardforge has no chunked_cross_entropy key (issue 30 item 2)"
    if variant.attention == "dense" and "sample_packing_keep_sdpa" not in known:
        return "not available: this shardforge has no sample_packing_keep_sdpa key (issue 35)"
    if variant.attention == "flex" and device == "cpu":
        return "flex_attention has no backward on CPU in this torch"
    if variant.attention == "varlen" and device != "cpu":
        import torch

        from shardforge.train.attention import varlen_missing

        if why := varlen_missing(torch.device(device)):
            return why
    return None


def config_for(
    variant: Variant, base: Path, data: Path, out: Path, args: argparse.Namespace
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "base_model": str(base),
        "output_dir": str(out),
        "seed": 0,
        "datasets": [{"path": str(data), "type": "completion", "field": "text"}],
        "sequence_len": args.sequence_len,
        "sample_packing": True,
        "micro_batch_size": args.micro_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "max_steps": args.warmup + args.steps,
        "learning_rate": 1e-5,
        "logging_steps": 1,
        "bf16": "auto",
    }
    for item in args.set:  # --set KEY=VALUE (YAML value; dotted keys nest)
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    cfg["attn_implementation"] = ATTENTION[variant.attention]  # the variant's own keys last
    cfg["gradient_checkpointing"] = variant.ac
    known = fields()
    if "torch_compile" in known:
        cfg["torch_compile"] = variant.compile
    if "chunked_cross_entropy" in known:
        cfg["chunked_cross_entropy"] = variant.chunked
    if "sample_packing_keep_sdpa" in known:  # dense: sdpa kept on transformers' dense mask
        cfg["sample_packing_keep_sdpa"] = variant.attention == "dense"
    return cfg


# -- one variant, in this process ----------------------------------------------------------------


def random_weights(
    model: Any, cfg: Any, device: Any, rank: int, weights: Any = None, quantized: Any = None
) -> None:
    """In place of `materialize_and_load`: the local shards on the device, drawn at random
    (norm weights 1), the computed buffers kept."""
    import torch

    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device="cpu" if cfg.fsdp.offload_params else device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name].to(buf.device))
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            else:
                param.normal_(0.0, 0.02)


def run_variant(variant: Variant, cfg_data: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Set up the run and time its steps on this rank (the process group is made here and
    destroyed after). Rank 0's figures; peak memory the largest over ranks."""
    import torch.distributed as dist

    from shardforge.config import validate_cfg
    from shardforge.train import loop
    from shardforge.train.diagnostics import MemoryMeter, StepMemory
    from shardforge.train.runtime import init_distributed

    cfg = validate_cfg(cfg_data)
    real = loop.materialize_and_load
    loop.materialize_and_load = random_weights  # put back below: --in_process shares the module
    rt = init_distributed()
    try:
        meter = MemoryMeter(rt.device)
        meter.reset()
        started = time.perf_counter()
        trainer = loop.Trainer(cfg, rt)
        trainer.setup()
        setup_s = time.perf_counter() - started
        setup_mib = meter.peak_mib()
        trainer.memory = StepMemory(MemoryMeter(rt.device), rt, detail_steps=1 << 30)
        times, records, phases = [], [], {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        for step in range(trainer.total_steps):
            _sync(rt.device)
            began = time.perf_counter()
            record = trainer.step()
            _sync(rt.device)
            times.append(time.perf_counter() - began)
            records.append(record)
            if step >= warmup:
                for phase, mib in trainer.memory.phases.items():
                    phases[phase] = max(phases[phase], mib)
        used = trainer.model.config._attn_implementation
        trainer.saver.close()
        for callback in reversed(trainer.callbacks):
            callback.on_end(trainer, False)
    finally:
        dist.destroy_process_group()
        loop.materialize_and_load = real
    return _figures(variant, cfg, rt, times, records, warmup) | {
        "attention_used": used,
        "setup_s": setup_s,
        "peak_memory_mib": {"setup": setup_mib, **phases},
        "memory_kind": meter.kind,
    }


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _figures(
    variant: Variant,
    cfg: Any,
    rt: Any,
    times: list[float],
    records: list[dict[str, Any]],
    warmup: int,
) -> dict[str, Any]:
    measured = times[warmup:] or times
    kept = records[warmup:] or records
    positions = cfg.micro_batch_size * cfg.gradient_accumulation_steps * rt.world_size
    positions *= cfg.sequence_len
    median = statistics.median(measured)
    return {
        "name": variant.name,
        "status": "ok",
        "steps": len(measured),
        "step_s_median": median,
        "tokens_per_s": positions * len(measured) / sum(measured),
        "real_tokens_per_s": sum(r["tokens"] for r in kept) / sum(measured),
        "first_step_s": times[0],
        "compile_s": times[0] - median if variant.compile else None,
        "losses": [r["loss"] for r in records],
    }


# -- driver --------------------------------------------------------------------------------------


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def child(variant: Variant, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One variant in a fresh process (torchrun with --nproc > 1); its JSON back."""
    result = workdir / f"result-{variant.name}.json"
    script = [str(Path(__file__).resolve()), "--worker", variant.name, "--result", str(result)]
    script += [f"--{k}={v}" for k, v in _passed(args).items()]
    script += [f"--set={item}" for item in args.set]
    launch = [sys.executable]
    if args.nproc > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    proc = subprocess.run(launch + script, check=False)
    if proc.returncode or not result.is_file():
        return {
            "name": variant.name,
            "status": "failed",
            "reason": f"exit status {proc.returncode}",
        }
    return json.loads(result.read_text())


def _passed(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("preset", "sequence_len", "micro_batch_size", "gradient_accumulation_steps")
    return {k: getattr(args, k) for k in (*keys, "warmup", "steps", "workdir", "data")}


def worker(args: argparse.Namespace) -> None:
    variant = Variant.parse(args.worker)
    workdir = Path(args.workdir)
    base, data = workdir / f"base-{args.preset}", Path(args.data)
    out = Path(tempfile.mkdtemp(prefix=f"out-{variant.name}-", dir=workdir))
    figures = run_variant(variant, config_for(variant, base, data, out, args), args.warmup)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps(figures))


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant of `args.variants`; the report (also written to `args.json`)."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    workdir = Path(args.workdir)
    world = args.nproc
    tokens = args.sequence_len * args.micro_batch_size * args.gradient_accumulation_steps
    tokens *= world * (args.warmup + args.steps) + world  # a window to spare per rank
    base, data = prepare(workdir, args.preset, tokens)
    args.data = str(data)
    facts = shape_facts(args.preset, args.sequence_len)
    rows = []
    for name in args.variants.split(","):
        variant = Variant.parse(name)
        if reason := skip_reason(variant, device):
            rows.append({"name": variant.name, "status": "skipped", "reason": reason})
            continue
        if args.in_process:
            out = Path(tempfile.mkdtemp(prefix=f"out-{variant.name}-", dir=workdir))
            row = run_variant(variant, config_for(variant, base, data, out, args), args.warmup)
        else:
            row = child(variant, args, workdir)
        if row["status"] == "ok":
            row["mfu"] = mfu(row["tokens_per_s"], facts["flops_per_token"], args.peak_tflops, world)
        rows.append(row)
    report = {
        "preset": args.preset,
        "shape": PRESETS[args.preset],
        **facts,
        "sequence_len": args.sequence_len,
        "micro_batch_size": args.micro_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "world_size": world,
        "warmup": args.warmup,
        "device": device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peak_tflops": args.peak_tflops,
        "mfu_formula": MFU_FORMULA,
        "config": args.set,
        "variants": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def table(report: dict[str, Any]) -> str:
    head = (
        f"{report['preset']}: {report['parameters'] / 1e9:.3f} B parameters, "
        f"{report['flops_per_token'] / 1e9:.3f} GFLOP/token at T={report['sequence_len']}, "
        f"micro_batch_size {report['micro_batch_size']} x {report['world_size']} rank(s), "
        f"{report['device']}, torch {report['torch']}\n{report['mfu_formula']}; peak "
        f"{report['peak_tflops']:g} TFLOP/s\n"
    )
    lines = [
        "| variant | attention | tokens/s | MFU | step s | compile s | peak MiB fwd/bwd/opt |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in report["variants"]:
        if row["status"] != "ok":
            lines.append(f"| {row['name']} | {row['status']}: {row['reason']} | | | | | |")
            continue
        mem = row["peak_memory_mib"]
        compile_s = "-" if row["compile_s"] is None else f"{row['compile_s']:.1f}"
        lines.append(
            f"| {row['name']} | {row['attention_used']} | {row['tokens_per_s']:,.0f} | "
            f"{100 * row['mfu']:.1f} % | {row['step_s_median']:.3f} | {compile_s} | "
            f"{mem['forward']:.0f} / {mem['backward']:.0f} / {mem['optimizer']:.0f} |"
        )
    return head + "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.2-1b")
    p.add_argument("--sequence_len", type=int, default=2048)
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3, help="steps before the measured ones")
    p.add_argument("--steps", type=int, default=10, help="measured steps per variant")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--peak_tflops", type=float, default=PEAK_TFLOPS)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another config key for every variant, e.g. optimizer=adamw_torch_fused or "
        "fsdp.offload_params=true (repeatable)",
    )
    p.add_argument("--nproc", type=int, default=1, help="ranks (torchrun) per variant")
    p.add_argument("--in_process", action="store_true", help="run the variants in this process")
    p.add_argument("--workdir", default=".bench/train_bench")
    p.add_argument("--json", default=".bench/train_bench.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workdir = str(Path(args.workdir).resolve())
    if args.in_process and args.nproc > 1:
        p.error("--in_process runs one rank; leave out --nproc")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    report = bench(args)
    print(table(report))
    print(f"written: {args.json}")
    return 0 if all(r["status"] != "failed" for r in report["variants"]) else 1


if __name__ == "__main__":
    sys.exit(main())
