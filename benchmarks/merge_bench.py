"""Merge benchmark: shardforge against the peers and against the disk's own copy speed.

Makes a synthetic, Llama-shaped DCP checkpoint of a chosen size (written by real `dcp.save` on
several gloo ranks, in the HF Trainer / accelerate layout), then measures, alternating the
contenders run by run:

- shardforge: `shardforge merge-sharded-fsdp-weights CFG --checkpoint DIR --output_path OUT`
- accelerate: `accelerate.utils.merge_fsdp_weights(DIR, OUT)` (the `bench` extra)
- dcp_to_torch_save: `torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DIR, OUT)`
- copy: `cp -r` of the shard files plus an fsync of the copy (the disk's reference)

Each contender runs in its own process; wall seconds, the process's peak RSS (from wait4) and the
output bytes are recorded. The script prints the medians and the ratios shardforge/peer.

    python benchmarks/merge_bench.py --size 1GB --repeats 3
    python benchmarks/merge_bench.py --size 4GB --dtype float32 --cache cold
    python benchmarks/merge_bench.py --size 4GB --contenders shardforge --baseline /tmp/old  # vs. a checkout

`--cache cold` evicts the checkpoint's files from the page cache before every run
(posix_fadvise DONTNEED after an fsync, no root needed); `--cache warm` reads them once first.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
PART_BYTES = 1 << 30  # tensors written per dcp.save call, per part (bounds the generator's memory)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


# ----------------------------------------------------------------------------- the checkpoint


def llama_config_for(size_bytes: int, dtype: str) -> dict[str, Any]:
    """A Llama-7B-like shape (hidden 2048/4096) with as many layers as the size asks for."""
    hidden, inter, vocab, heads, kv = 2048, 5632, 32000, 16, 8
    if size_bytes < 10**9:
        hidden, inter, heads, kv = 512, 1408, 8, 4
    elif size_bytes >= 8 * 10**9:
        hidden, inter, heads, kv = 4096, 11008, 32, 8
    head_dim = hidden // heads
    per_layer = hidden * hidden * 2 + hidden * kv * head_dim * 2 + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((size_bytes / DTYPE_BYTES[dtype] - fixed) / per_layer))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def param_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes in LlamaForCausalLM's order, from the config alone."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kvd = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kvd, h)),
            (p + "self_attn.v_proj.weight", (kvd, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def _write_part(
    rank: int, world: int, part_dir: str, names: list[str], shapes: list[list[int]], dtype: str
) -> None:
    """On every rank: this part's tensors as dim-0-sharded DTensors, written by dcp.save."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(1234 + rank)
    # Random values, tiled from one block: content does not matter to the merge, and drawing
    # gigabytes of random numbers would dominate the generator's time.
    block = torch.randn(1 << 22, generator=gen).to(getattr(torch, dtype))
    state: dict[str, Any] = {}
    for name, shape in zip(names, shapes, strict=True):
        rows = shape[0]
        per = -(-rows // world)  # torch.chunk semantics: ceil, the last ranks may get less or none
        start, stop = min(rank * per, rows), min((rank + 1) * per, rows)
        local = torch.empty((stop - start, *shape[1:]), dtype=getattr(torch, dtype))
        flat = local.view(-1)
        for at in range(0, flat.numel(), block.numel()):
            n = min(block.numel(), flat.numel() - at)
            flat[at : at + n] = block[:n]
        stride = torch.empty(shape, device="meta").stride()
        state[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
        )
    dcp.save({"model": state}, checkpoint_id=part_dir)  # keys `model.<fqn>`, as HF Trainer writes


def make_checkpoint(root: Path, size_bytes: int, dtype: str, ranks: int) -> tuple[Path, Path]:
    """Write base config + tokenizer and `checkpoint-1/pytorch_model_fsdp_0/`; return (cfg, dcp)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from shardforge.io.unpickler import load_metadata_pickle
    from shardforge.testing.dist import run_on_ranks
    from shardforge.testing.tiny import make_tokenizer

    cfg = llama_config_for(size_bytes, dtype)
    base = root / "base"
    base.mkdir(parents=True, exist_ok=True)
    (base / "config.json").write_text(json.dumps(cfg, indent=2))
    make_tokenizer().save_pretrained(base)
    ckpt = root / "out" / "checkpoint-1" / "pytorch_model_fsdp_0"
    done = ckpt / ".metadata"
    if done.exists():
        print(f"reusing checkpoint {ckpt}", file=sys.stderr)
        return write_bench_config(root, base), ckpt
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)

    # Parts of about PART_BYTES each, written separately (bounded memory, checkpoints larger than
    # RAM), then joined into one DCP directory: data files renamed, metadata combined.
    shapes = param_shapes(cfg)
    parts: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    part_bytes = 0
    for name, shape in shapes:
        nbytes = DTYPE_BYTES[dtype]
        for d in shape:
            nbytes *= d
        if parts[-1] and part_bytes + nbytes > PART_BYTES * ranks:
            parts.append([])
            part_bytes = 0
        parts[-1].append((name, shape))
        part_bytes += nbytes
    merged: Metadata | None = None
    t0 = time.perf_counter()
    for index, part in enumerate(parts):
        part_dir = root / f"part-{index}"
        shutil.rmtree(part_dir, ignore_errors=True)
        run_on_ranks(
            _write_part,
            ranks,
            str(part_dir),
            [n for n, _ in part],
            [list(s) for _, s in part],
            dtype,
        )
        # even our own file goes through the allow-list reader (torch's classes, for re-saving)
        meta = load_metadata_pickle(part_dir / ".metadata", as_torch=True)
        renames = {}
        for src in part_dir.glob("*.distcp"):
            new = src.name.replace(".distcp", f"_p{index}.distcp")
            src.rename(ckpt / new)
            renames[src.name] = new
        for info in meta.storage_data.values():
            info.relative_path = renames[info.relative_path]
        if merged is None:
            merged = meta
        else:
            merged.state_dict_metadata.update(meta.state_dict_metadata)
            merged.storage_data.update(meta.storage_data)
            if merged.planner_data is not None and meta.planner_data is not None:
                merged.planner_data.update(meta.planner_data)
        shutil.rmtree(part_dir)
        print(
            f"  wrote part {index + 1}/{len(parts)} ({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
        )
    with (ckpt / ".metadata.tmp").open("wb") as f:
        pickle.dump(merged, f)
    os.replace(ckpt / ".metadata.tmp", done)
    subprocess.run(["sync"], check=False)
    return write_bench_config(root, base), ckpt


def write_bench_config(root: Path, base: Path) -> Path:
    cfg_path = root / "bench.yml"
    cfg_path.write_text(f"base_model: {base}\noutput_dir: {root / 'out'}\n")
    return cfg_path


# ----------------------------------------------------------------------------- the contenders

PEER_SNIPPETS = {
    "accelerate": """
        from accelerate.utils import merge_fsdp_weights
        merge_fsdp_weights(sys.argv[1], sys.argv[2], safe_serialization=True)
    """,
    "dcp_to_torch_save": """
        import os
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        os.makedirs(sys.argv[2], exist_ok=True)
        dcp_to_torch_save(sys.argv[1], os.path.join(sys.argv[2], "model.pt"))
    """,
}


def command_for(name: str, cfg: Path, ckpt: Path, out: Path, baseline: str = "") -> list[str]:
    merge = ["merge-sharded-fsdp-weights", str(cfg), "--checkpoint", str(ckpt),
             "--output_path", str(out), "--quiet", "--no-save-tokenizer"]  # fmt: skip
    if name == "shardforge":
        return [str(Path(sys.executable).parent / "shardforge"), *merge]
    if name == "baseline":  # another checkout's source (e.g. the previous release), same packages
        return ["env", f"PYTHONPATH={Path(baseline).resolve() / 'src'}", sys.executable, "-m",
                "shardforge", *merge]  # fmt: skip
    if name == "copy":
        files = " ".join(f"'{p}'" for p in sorted(ckpt.glob("*.distcp")))
        return ["bash", "-c", f"mkdir -p '{out}' && cp {files} '{out}/' && sync '{out}'/*"]
    code = "import sys\n" + textwrap.dedent(PEER_SNIPPETS[name])
    return [sys.executable, "-c", code, str(ckpt), str(out)]


@dataclass
class Result:
    seconds: list[float] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)
    out_bytes: int = 0
    failure: str = ""


# Runs the contender from a small process, so that its peak RSS is not inflated by a fork of this
# (torch-sized) process: ru_maxrss of a child counts the memory image it had before exec.
LAUNCHER = """
import json, os, resource, sys, time
out, limit, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execvp(cmd[0], cmd)
_, status = os.waitpid(pid, 0)
seconds = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
code = os.waitstatus_to_exitcode(status)
with open(out, "w") as f:
    json.dump({"seconds": seconds, "rss": rss, "code": code}, f)
"""


def run_one(cmd: list[str], limit_bytes: int | None, scratch: Path) -> tuple[float, int, int, str]:
    """(wall seconds, peak RSS bytes, exit status, stderr tail) of one contender process."""
    report = scratch / "run.json"
    launcher = [sys.executable, "-S", "-c", LAUNCHER, str(report), str(limit_bytes or 0)]
    proc = subprocess.run(launcher + cmd, stderr=subprocess.PIPE, check=False)
    err = proc.stderr.decode(errors="replace")
    r = json.loads(report.read_text())
    return r["seconds"], r["rss"], r["code"], err[-600:]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evict(files: list[Path]) -> None:
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(files: list[Path]) -> None:
    for p in files:
        with p.open("rb") as f:
            while f.read(1 << 24):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size", default="1GB", help="checkpoint size, decimal units (1GB = 10^9 B)"
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--ranks", type=int, default=2, help="ranks writing the checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contenders", default="shardforge,accelerate,dcp_to_torch_save,copy")
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold")
    parser.add_argument("--workdir", default=".bench", help="where the checkpoint and outputs go")
    parser.add_argument(
        "--peer-mem-limit", default="", help="address-space cap for peers, e.g. 20GB"
    )
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    parser.add_argument(
        "--baseline",
        default="",
        help="a checkout of another shardforge version (e.g. `git worktree add /tmp/old <ref>`): "
        "adds the contender `baseline`, its merge run from that source with these packages",
    )
    args = parser.parse_args()

    size = parse_size(args.size)
    root = Path(args.workdir).resolve() / f"llama-{args.size}-{args.dtype}-{args.ranks}r"
    print(
        f"making a {human(size)} {args.dtype} checkpoint on {args.ranks} ranks in {root}",
        file=sys.stderr,
    )
    cfg, ckpt = make_checkpoint(root, size, args.dtype, args.ranks)
    files = [*sorted(ckpt.glob("*.distcp")), ckpt / ".metadata"]
    ckpt_bytes = sum(p.stat().st_size for p in files)
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if args.baseline and "baseline" not in names:
        names.append("baseline")
    results = {n: Result() for n in names}
    peer_limit = parse_size(args.peer_mem_limit) if args.peer_mem_limit else None

    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # alternate who goes first
        for name in order:
            res = results[name]
            if res.failure:
                continue
            out = root / f"merged-{name}"
            shutil.rmtree(out, ignore_errors=True)
            (evict if args.cache == "cold" else warm)(files)
            limit = peer_limit if name not in ("shardforge", "baseline", "copy") else None
            cmd = command_for(name, cfg, ckpt, out, args.baseline)
            seconds, rss, code, err = run_one(cmd, limit, root)
            if code != 0:
                res.failure = f"exit {code}: {err.strip().splitlines()[-1] if err.strip() else ''}"
                print(f"  {name}: FAILED ({res.failure})", file=sys.stderr)
            else:
                res.seconds.append(seconds)
                res.peak_rss.append(rss)
                res.out_bytes = dir_bytes(out)
                print(
                    f"  run {rep + 1} {name}: {seconds:.2f} s, peak RSS {human(rss)}",
                    file=sys.stderr,
                )
            shutil.rmtree(out, ignore_errors=True)

    print(f"\ncheckpoint: {human(ckpt_bytes)} {args.dtype}, {len(files) - 1} files, "
          f"{args.ranks} ranks; cache: {args.cache}; repeats: {args.repeats}")  # fmt: skip
    print(
        f"{'contender':<20}{'median s':>10}{'MB/s':>10}{'peak RSS':>12}{'RSS/ckpt':>10}{'output':>12}"
    )
    table: dict[str, Any] = {"checkpoint_bytes": ckpt_bytes, "cache": args.cache, "results": {}}
    for name, res in results.items():
        if not res.seconds:
            print(f"{name:<20}{'failed: ' + res.failure}")
            table["results"][name] = {"failure": res.failure}
            continue
        med = statistics.median(res.seconds)
        rss = max(res.peak_rss)
        print(f"{name:<20}{med:>10.2f}{ckpt_bytes / med / 1e6:>10.0f}{human(rss):>12}"
              f"{rss / ckpt_bytes:>10.1%}{human(res.out_bytes):>12}")  # fmt: skip
        table["results"][name] = {"median_s": med, "runs_s": res.seconds, "peak_rss": rss,
                                  "output_bytes": res.out_bytes}  # fmt: skip
    ours = results.get("shardforge")
    if ours and ours.seconds:
        mine = statistics.median(ours.seconds)
        for name, res in results.items():
            if name != "shardforge" and res.seconds:
                ratio = mine / statistics.median(res.seconds)
                print(f"shardforge / {name}: {ratio:.2f}x the time")
                table["results"][name]["shardforge_time_ratio"] = ratio
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
