"""Memory and speed of a full fine-tune, LoRA, 8-bit LoRA and QLoRA at one model shape.

    python benchmarks/quant_bench.py --preset llama-3.2-1b --nproc 2 --sequence_len 256 \\
        --micro_batch_size 1 --warmup 1 --steps 2
    python benchmarks/quant_bench.py --layers 4 ...     # the preset's shape with fewer blocks
    python benchmarks/quant_bench.py --set bfloat16=true ...   # a config key for every mode

Each mode is one run of shardforge's own training step (`train_bench.run_variant`: the config
validated, `Trainer.setup`, `Trainer.step`; eager, sdpa), on `--nproc` ranks started by torchrun,
in a fresh process group each: `full` (every parameter trained), `lora` (`adapter: lora`, every
linear layer of the blocks, r 16), `lora-8bit` (the same over int8 base weights:
`load_in_8bit`), `qlora` (over NF4 base weights: `adapter: qlora`, `load_in_4bit`). The weights
are random (no checkpoint is read); the quantized ones go through the product's own path
(`quant.load_quantized`: quantized whole, cut into each rank's rows).

Printed per mode: the parameter bytes one rank holds after sharding (the packed data and
scales of a quantized weight, not the float size it dequantizes to), the setup's seconds
(`Trainer.setup`: for 8-bit and QLoRA mostly the quantization of the base weights), the peak
memory of the setup and of the forward / backward / optimizer phases (the largest over the
ranks: CUDA max allocated on a GPU, the RSS high-water mark on CPU, which includes the
process's libraries), tokens/s and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# train_bench (this directory is on sys.path when the script runs) and the test helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_bench as tb

MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "lora": {"adapter": "lora"},
    "lora-8bit": {"adapter": "lora", "load_in_8bit": True},
    "qlora": {"adapter": "qlora", "load_in_4bit": True},
}
LORA = {"lora_r": 16, "lora_alpha": 32, "lora_target_linear": True}


def random_weights(
    model: Any, cfg: Any, device: Any, rank: int, weights: Any = None, quantized: Any = None
) -> None:
    """train_bench's random weights; each quantized weight drawn whole on rank 0 (one at a
    time) and loaded by `quant.load_quantized`."""
    import torch

    from shardforge.train.quant import load_quantized

    names = set(quantized or ())
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device="cpu" if cfg.fsdp.offload_params else device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name].to(buf.device))
        for name, param in model.named_parameters():
            if name in names:
                continue
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            elif ".lora_B." in name:
                param.zero_()
            else:
                param.normal_(0.0, 0.02)
    if names:
        shapes = {n: p.shape for n, p in model.named_parameters() if n in names}
        load_quantized(model, _Drawn(shapes), names, device)


class _Drawn(dict[str, Any]):
    """A full weight drawn when `load_quantized` takes it (never all at once)."""

    def __init__(self, shapes: dict[str, Any]) -> None:
        super().__init__()
        self.shapes = shapes

    def pop(self, key: str, *default: Any) -> Any:
        import torch

        return torch.randn(self.shapes[key]) * 0.02


def no_base_weights(model: Any, cfg: Any, is_main: bool) -> dict[str, Any]:
    """In place of `lora.prepare_lora`: the adapter injected, no weights read."""
    from shardforge.train.lora import add_lora

    add_lora(model, cfg)
    return {}


def local_parameter_mib(model: Any) -> float:
    from shardforge.train.diagnostics import _local, stored_bytes

    return sum(stored_bytes(_local(p)) for p in model.parameters()) / 2**20


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """On each rank: one mode's run (train_bench's); rank 0 writes the figures."""
    from shardforge.train import loop

    variant = tb.Variant.parse("eager+sdpa")
    out = Path(tempfile.mkdtemp(prefix=f"out-{mode}-", dir=workdir))
    base = workdir / f"base-{args.preset}"
    cfg = tb.config_for(variant, base, Path(args.data), out, args)
    cfg.update(MODES[mode], **(LORA if mode != "full" else {}))
    tb.random_weights = random_weights
    loop.prepare_lora = no_base_weights
    held: dict[str, float] = {}
    setup = loop.Trainer._setup_model

    def measured_setup(trainer: Any) -> None:
        setup(trainer)
        held["mib"] = local_parameter_mib(trainer.model)

    loop.Trainer._setup_model = measured_setup  # type: ignore[method-assign]
    row = tb.run_variant(variant, cfg, args.warmup)
    return {**row, "name": mode, "local_param_mib": held["mib"]}


def worker(args: argparse.Namespace) -> None:
    row = run_mode(args.worker, args, Path(args.workdir))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps(row))


def child(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    result = workdir / f"result-{mode}.json"
    result.unlink(missing_ok=True)
    script = [str(Path(__file__).resolve()), "--worker", mode, "--result", str(result)]
    for key in ("preset", "layers", "sequence_len", "micro_batch_size", "warmup", "steps"):
        script.append(f"--{key}={getattr(args, key)}")
    script += [f"--workdir={args.workdir}", f"--data={args.data}"]
    script += [f"--set={item}" for item in args.set]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run([*launch, f"--nproc_per_node={args.nproc}", *script], check=False)
    if proc.returncode or not result.is_file():
        return {"name": mode, "status": "failed", "reason": f"exit status {proc.returncode}"}
    return dict(json.loads(result.read_text()))


def table(rows: list[dict[str, Any]], head: str) -> str:
    lines = [
        head,
        "| mode | params MiB / rank | setup s | peak MiB setup | peak MiB fwd / bwd / opt "
        "| tokens/s | losses |",
        "| --- | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']}: {r['reason']} | | | | | |")
            continue
        mem = r["peak_memory_mib"]
        losses = ", ".join(f"{x:.3f}" for x in r["losses"])
        lines.append(
            f"| {r['name']} | {r['local_param_mib']:,.0f} | {r['setup_s']:,.0f} | "
            f"{mem['setup']:,.0f} | "
            f"{mem['forward']:,.0f} / {mem['backward']:,.0f} / {mem['optimizer']:,.0f} | "
            f"{r['tokens_per_s']:,.1f} | {losses} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(tb.PRESETS), default="llama-3.2-1b")
    p.add_argument("--layers", type=int, default=0, help="blocks (0: the preset's)")
    p.add_argument("--sequence_len", type=int, default=256)
    p.add_argument("--micro_batch_size", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key for every mode (YAML value), e.g. bfloat16=true",
    )
    p.add_argument("--workdir", default=".bench/quant_bench")
    p.add_argument("--json", default=".bench/quant_bench.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workdir = str(Path(args.workdir).resolve())
    # train_bench's config_for reads these
    args.gradient_accumulation_steps = 1
    if args.layers:
        tb.PRESETS[args.preset] = {**tb.PRESETS[args.preset], "num_hidden_layers": args.layers}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    workdir = Path(args.workdir)
    tokens = args.sequence_len * args.micro_batch_size * (args.nproc * (args.warmup + args.steps))
    _, data = tb.prepare(workdir, args.preset, tokens + args.sequence_len * args.nproc)
    args.data = str(data)
    rows = [child(mode, args, workdir) for mode in args.modes.split(",")]
    facts = tb.shape_facts(args.preset, args.sequence_len)
    head = (
        f"{args.preset} shape ({facts['layers']} blocks, {facts['parameters'] / 1e9:.3f} B "
        f"parameters), sequence_len {args.sequence_len} x micro_batch_size "
        f"{args.micro_batch_size} x {args.nproc} rank(s), {tb.device_name()}; "
        f"{args.warmup} warmup + {args.steps} measured steps"
    )
    if args.set:
        head += "; " + ", ".join(args.set)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"head": head, "modes": rows}, indent=2))
    print(table(rows, head))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
