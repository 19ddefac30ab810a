"""A model of the distributed merge on N nodes of a shared file system, for real layouts.

It builds the tensor list of Llama-3 70B and 405B from their config numbers (no weights, no
download), plans the merged output with the merge's own planner
(`shardforge.sinks.plan.plan_output`, the shard files `save_pretrained` would write), and splits
the output bytes over the ranks of N nodes with the distributed merge's own split
(`shardforge.merge.distributed.shares`). It prints, per node count:

- the bytes each node writes (largest and smallest node, and the largest over the mean);
- what a split by whole files would give instead (greedy, largest file first, per rank), which
  is how a peer that splits conversion by file count balances: the largest rank's bytes and the
  ranks left without a file;
- the expected merge time from three rates: a per-rank byte rate measured on a real machine
  (`--rank-mbps`, from `merge_bench.py`), a per-node network rate, and the shared file system's
  aggregate bandwidth (`--fs-gbps`, an assumption you state), plus a fixed start-up.

    python benchmarks/node_model.py --rank-mbps 250 --startup-s 7 --fs-gbps 20
    python benchmarks/node_model.py --model 405b --ranks-per-node 8 --max-shard-size 5GB

The time model: every output byte is read once from the checkpoint and written once (a stored
dtype wider than the output reads more: `--stored-dtype float32` for an FSDP checkpoint of
float32 master weights merged to bfloat16). Three bounds: the busiest rank at the per-rank rate,
the busiest node at its network rate, and all bytes at the file system's aggregate bandwidth.
The slowest of them, plus the start-up every rank pays (imports, metadata, the meta-device
architecture: it does not shrink with more nodes), is the merge time.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from shardforge.merge.distributed import shares
from shardforge.sinks.plan import OutputPlan, TensorSpec, plan_output


@dataclass(frozen=True)
class LlamaShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False


# The published config.json numbers of Meta's Llama 3.1 70B and 405B (Llama 3 70B is the same).
MODELS = {
    "70b": LlamaShape("Llama-3.1-70B", 8192, 80, 64, 8, 28672, 128256),
    "405b": LlamaShape("Llama-3.1-405B", 16384, 126, 128, 8, 53248, 128256),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def llama_specs(m: LlamaShape, dtype: torch.dtype) -> list[TensorSpec]:
    """Every saved tensor of LlamaForCausalLM with these numbers, as transformers names it."""
    h, i, v = m.hidden, m.intermediate, m.vocab
    kv = m.kv_heads * (h // m.heads)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(m.layers):
        p = f"model.layers.{n}."
        shapes += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not m.tied:
        shapes.append(("lm_head.weight", (v, h)))
    return [TensorSpec(name, dtype, shape) for name, shape in shapes]


def rank_bytes(plan: OutputPlan, world: int) -> list[int]:
    """Tensor bytes each rank writes under the distributed merge's split."""
    out = [0] * world
    for rank in range(world):
        for s in shares(plan, rank, world):
            rows = s.tensor.spec.shape[0] if s.tensor.spec.shape else 1
            out[rank] += (s.rows[1] - s.rows[0]) * (s.tensor.spec.nbytes // rows)
    return out


def per_node(ranks: list[int], ranks_per_node: int) -> list[int]:
    """Sum ranks' bytes by node (torchrun numbers ranks node by node: node k holds ranks
    k*R .. k*R+R-1)."""
    return [sum(ranks[i : i + ranks_per_node]) for i in range(0, len(ranks), ranks_per_node)]


def files_per_node(plan: OutputPlan, nodes: int, ranks_per_node: int) -> int:
    """The most output files one node writes into."""
    world = nodes * ranks_per_node
    names: list[set[str]] = [set() for _ in range(nodes)]
    for rank in range(world):
        names[rank // ranks_per_node].update(s.file.name for s in shares(plan, rank, world))
    return max(len(n) for n in names)


def by_file_split(plan: OutputPlan, world: int) -> list[int]:
    """Whole files per rank, greedy (largest file to the least loaded rank)."""
    load = [0] * world
    for size in sorted((f.size for f in plan.files), reverse=True):
        load[load.index(min(load))] += size
    return load


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="output")
    parser.add_argument(
        "--stored-dtype",
        default="",
        choices=["", *sorted(DTYPES)],
        help="the checkpoint's dtype (default: the output's; float32 = master weights, cast)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="output shard size (the published checkpoints use 5GB; transformers 5's "
        "save_pretrained default is 50GB)",
    )
    parser.add_argument("--nodes", default="1,2,4,8,16,32,64")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument(
        "--rank-mbps",
        type=float,
        default=250.0,
        help="output MB/s one rank sustains (measured with merge_bench.py)",
    )
    parser.add_argument(
        "--node-gbps", type=float, default=12.5, help="a node's network, GB/s (100 Gb/s)"
    )
    parser.add_argument(
        "--fs-gbps",
        type=float,
        default=20.0,
        help="the shared file system's aggregate bandwidth, reads plus writes, GB/s (assumed)",
    )
    parser.add_argument(
        "--startup-s", type=float, default=7.0, help="imports + metadata + meta model (measured)"
    )
    args = parser.parse_args()

    out_dtype = DTYPES[args.dtype]
    stored = DTYPES[args.stored_dtype] if args.stored_dtype else out_dtype
    traffic = 1 + stored.itemsize / out_dtype.itemsize  # bytes moved per output byte
    counts = [int(n) for n in args.nodes.split(",")]
    r = args.ranks_per_node
    print(
        f"assumed: {args.rank_mbps:.0f} MB/s per rank (measured), {args.node_gbps} GB/s per "
        f"node network, {args.fs_gbps} GB/s shared file system (reads + writes), start-up "
        f"{args.startup_s:.1f} s; checkpoint {stored} -> output {out_dtype} ({traffic:.1f} bytes "
        f"moved per output byte); {r} ranks per node"
    )
    rank_rate = args.rank_mbps * 1e6
    for key in MODELS if args.model == "all" else [args.model]:
        m = MODELS[key]
        specs = llama_specs(m, out_dtype)
        params = sum(math.prod(s.shape) for s in specs)
        plan = plan_output(specs, args.max_shard_size, params)
        total = sum(t.spec.nbytes for _, t in plan.tensors())
        largest = max(s.nbytes for s in specs)
        print(
            f"\n{m.name}: {params / 1e9:.1f}B parameters, {len(specs)} tensors, output "
            f"{human(plan.total_bytes)} in {len(plan.files)} files of <= {args.max_shard_size} "
            f"(largest tensor {human(largest)})"
        )
        print(
            f"{'nodes':>5} {'ranks':>5} {'max node':>10} {'min node':>10} {'max/mean':>9} "
            f"{'files/node':>10} {'time s':>7}  {'bound':<12} {'by-file: max rank':>17} "
            f"{'idle ranks':>10} {'time s':>7}  bound"
        )
        nic_rate = args.node_gbps * 1e9 / traffic
        fs_time = total * traffic / (args.fs_gbps * 1e9)

        def seconds(
            ranks: list[int], nic: float = nic_rate, fs: float = fs_time
        ) -> tuple[float, str]:
            bounds = {
                "ranks": max(ranks) / rank_rate,
                "node network": max(per_node(ranks, r)) / nic,
                "file system": fs,
            }
            bound = max(bounds, key=lambda k: bounds[k])
            return args.startup_s + bounds[bound], bound

        for n in counts:
            ours = rank_bytes(plan, n * r)
            nodes = per_node(ours, r)
            assert sum(nodes) == total  # every byte exactly once
            files = by_file_split(plan, n * r)
            t_ours, b_ours = seconds(ours)
            t_files, b_files = seconds(files)
            print(
                f"{n:>5} {n * r:>5} {human(max(nodes)):>10} {human(min(nodes)):>10} "
                f"{max(nodes) / (total / n):>9.4f} {files_per_node(plan, n, r):>10} "
                f"{t_ours:>7.0f}  {b_ours:<12} {human(max(files)):>17} "
                f"{sum(1 for f in files if f == 0):>10} {t_files:>7.0f}  {b_files}"
            )


if __name__ == "__main__":
    main()
