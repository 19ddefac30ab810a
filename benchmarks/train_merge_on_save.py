"""merge_on_save benchmark: what merging every checkpoint in the background costs the training.

Makes a small Llama (float32, about 24M parameters by default) and a completion dataset, then
trains it with `shardforge train` on 2 gloo CPU ranks, alternating run by run:

- off: `merge_on_save: false` (the reference)
- every: `merge_on_save: true` (every checkpoint merged into output_dir/merged/checkpoint-N by a
  separate low-priority process while training goes on)
- final: `merge_on_save: final` (only the newest checkpoint kept merged)

Each run's per-step times come from its `metrics.jsonl` (tokens / tokens_per_s: the step loop's
own clock, from the start of the step to after the optimizer step), so start-up and the wait for
the last merge at the end are not in them; the run's wall time (which includes that wait) is
reported beside. The first `--skip` steps (warm-up) are left out. Printed: median, mean and p90
step time per variant, the mean step time of the steps that follow a save (where a merge is
running) and of the others, the wall time, the number of merged models, and the ratios to `off`.
The final losses of the variants must be equal (merge_on_save never changes training); the
script says so and fails otherwise.

    python benchmarks/train_merge_on_save.py --repeats 3
    python benchmarks/train_merge_on_save.py --layers 4 --max-steps 30 --save-steps 10

On a machine with as many cores as training ranks (2 here) the merge process competes with the
ranks for CPU: it runs at niceness +10 with one thread, so the figure measured here is an upper
bound for a GPU node, where the ranks wait on the GPU and the merge uses an otherwise idle core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# the test helpers (tiny models, CPU ranks) live in tests/helpers/, outside the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VARIANTS = {"off": False, "every": True, "final": "final"}


def make_inputs(root: Path, layers: int, hidden: int) -> tuple[Path, Path]:
    from helpers.tiny import make_model, tiny_texts, write_jsonl

    base = root / "base"
    if not (base / "config.json").exists():
        make_model(
            base,
            "llama",
            vocab_size=320,
            seed=0,
            hidden_size=hidden,
            intermediate_size=hidden * 11 // 4,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=hidden // 8,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        )
    data = root / "stories.jsonl"
    if not data.exists():
        write_jsonl(data, [{"text": t} for t in tiny_texts(2048, seed=0)])
    return base, data


def config_for(
    base: Path, data: Path, out: Path, variant: str, args: argparse.Namespace
) -> dict[str, Any]:
    return {
        "base_model": str(base),
        "output_dir": str(out),
        "seed": 42,
        "datasets": [{"path": str(data), "type": "completion", "field": "text"}],
        "sequence_len": args.sequence_len,
        "sample_packing": True,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_steps": args.max_steps,
        "learning_rate": 1.0e-3,
        "lr_scheduler": "cosine",
        "warmup_steps": 2,
        "optimizer": "adamw_torch",
        "save_steps": args.save_steps,
        "logging_steps": args.max_steps,
        "merge_on_save": VARIANTS[variant],
        "fsdp": {
            "fsdp_version": 2,
            "reshard_after_forward": True,
            "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "state_dict_type": "SHARDED_STATE_DICT",
        },
    }


def step_times(metrics: Path) -> list[tuple[int, float, float]]:
    """(step, seconds, loss) per step of a run's metrics.jsonl."""
    rows = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "tokens_per_s" in row and "tokens" in row:
            rows.append((row["step"], row["tokens"] / row["tokens_per_s"], row["loss"]))
    return rows


def run_once(root: Path, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    base, data = make_inputs(root, args.layers, args.hidden)
    out = root / f"out-{variant}"
    shutil.rmtree(out, ignore_errors=True)
    cfg_path = root / f"{variant}.yml"
    cfg_path.write_text(yaml.safe_dump(config_for(base, data, out, variant, args)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "shardforge.cli.main", "train", str(cfg_path)]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{variant}: train failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = step_times(out / "metrics.jsonl")
    merged = sorted(p.name for p in (out / "merged").glob("checkpoint-*"))
    saves = set(range(args.save_steps, args.max_steps + 1, args.save_steps))

    def after_save(step: int) -> bool:
        return any(0 < step - k <= args.window for k in saves)

    kept = [(step, s) for step, s, _ in rows if step > args.skip]
    shutil.rmtree(out, ignore_errors=True)
    return {
        "steps": [s for _, s in kept],
        "after_save": [s for step, s in kept if after_save(step)],
        "other": [s for step, s in kept if not after_save(step)],
        "final_loss": rows[-1][2],
        "wall": wall,
        "load": load,
        "merged": merged,
    }


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="off,every,final")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--sequence-len", type=int, default=256)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    parser.add_argument(
        "--window", type=int, default=5, help="steps after a save counted as 'after a save'"
    )
    parser.add_argument("--workdir", default=".bench/merge_on_save")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    root = Path(args.workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # alternate who goes first
        for name in order:
            r = run_once(root, name, args)
            runs[name].append(r)
            print(
                f"  run {rep + 1} {name}: median step {statistics.median(r['steps']) * 1e3:.0f} ms, "
                f"wall {r['wall']:.1f} s, merged {len(r['merged'])}, load before {r['load']:.2f}",
                file=sys.stderr,
            )
    table: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        steps = [s for r in rs for s in r["steps"]]
        table[name] = {
            "median_ms": statistics.median(steps) * 1e3,
            "mean_ms": statistics.fmean(steps) * 1e3,
            "p90_ms": p90(steps) * 1e3,
            "after_save_ms": statistics.fmean([s for r in rs for s in r["after_save"]]) * 1e3,
            "other_ms": statistics.fmean([s for r in rs for s in r["other"]]) * 1e3,
            "wall_s": statistics.median(r["wall"] for r in rs),
            "merged": statistics.median(len(r["merged"]) for r in rs),
            "load": statistics.median(r["load"] for r in rs),
        }
    losses = {name: {r["final_loss"] for r in rs} for name, rs in runs.items()}
    same = len(set().union(*losses.values())) == 1
    print(
        f"\nmodel: Llama {args.layers} layers x {args.hidden} hidden, float32; {args.max_steps} "
        f"steps of 2 ranks x 4 x {args.sequence_len} tokens; a checkpoint every "
        f"{args.save_steps} steps; repeats {args.repeats}; {os.cpu_count()} cores; "
        f"steps after a save: the {args.window} following each"
    )
    print(f"{'variant':<9}{'median ms':>10}{'mean ms':>9}{'p90 ms':>8}{'after save':>11}"
          f"{'other':>8}{'wall s':>8}{'merged':>7}{'mean/off':>9}{'load':>6}")  # fmt: skip
    ref = table.get("off")
    for name, row in table.items():
        ratio = f"{row['mean_ms'] / ref['mean_ms']:.2f}x" if ref else "-"
        print(f"{name:<9}{row['median_ms']:>10.0f}{row['mean_ms']:>9.0f}{row['p90_ms']:>8.0f}"
              f"{row['after_save_ms']:>11.0f}{row['other_ms']:>8.0f}{row['wall_s']:>8.1f}"
              f"{row['merged']:>7.0f}{ratio:>9}{row['load']:>6.2f}")  # fmt: skip
    print(f"final losses {'identical' if same else 'DIFFER'}: {losses}")
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "runs": runs}, indent=2))
    if not same:
        sys.exit("merge_on_save changed the training losses")


if __name__ == "__main__":
    main()
