"""Merge benchmark: shardforge against the peers and against the disk's own copy speed.

Makes a synthetic, Llama-shaped DCP checkpoint of a chosen size (written by real `dcp.save` on
several gloo ranks, in the HF Trainer / accelerate layout), then measures, alternating the
contenders run by run:

- shardforge: `shardforge merge-sharded-fsdp-weights CFG --checkpoint DIR --output_path OUT`
- shardforge_cast: the same with `--dtype bfloat16` (a float32 checkpoint: every byte is cast)
- shardforge_Nranks (e.g. shardforge_2ranks): the same with `--nproc_per_node N` (torchrun, gloo)
- shardforge_dry_run: the same with `--dry_run`: imports, metadata, the meta-device
  architecture, every check and the plan, and no byte written (the merge's fixed start-up cost)
- shardforge_nomanifest: the same merge with the integrity manifest turned off
  (`shardforge.sinks.manifest.ENABLED = False`: nothing hashed, the copy in read order): the
  manifest's extra time is shardforge's over this one's
- accelerate: `accelerate.utils.merge_fsdp_weights(DIR, OUT)` (the `bench` extra)
- dcp_to_torch_save: `torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DIR, OUT)`
- copy: `cp -r` of the checkpoint directory plus `sync` of the copied files (the disk's reference)
- shardforge_s3: the checkpoint in object storage, merged to object storage
  (`--checkpoint s3://... --output_path s3://...`), on a SeaweedFS started on loopback
  (tests/helpers/s3.py; the checkpoint is uploaded once, untimed)
- s3_download_merge_upload: what a user does without it: download the checkpoint (s3fs), merge
  it locally with shardforge, upload the merged directory (s3fs)

Each contender runs in its own process (tree); wall seconds, its CPU seconds (user + kernel of
the processes it waited for: a figure the machine's other load changes less than the wall
time), the peak RSS of its largest process (from wait4), the peak of the whole process tree's summed RSS (sampled every 50 ms: a multi-rank
merge is several processes), the 1-minute load average before the run (the machine may be shared)
and the output bytes are recorded. The script prints the medians and the ratios to shardforge
and to the copy.

    python benchmarks/merge_bench.py --size 1GB --repeats 3
    python benchmarks/merge_bench.py --size 4GB --dtype float32 --cache cold
    python benchmarks/merge_bench.py --size 4GB --ranks 1 --cache cold --contenders copy,shardforge,accelerate
    python benchmarks/merge_bench.py --node                      # a GPU node: 5 GB, one rank, cold
    python benchmarks/merge_bench.py --node --threads 4          # the same with 4 copy threads
    python benchmarks/merge_bench.py --node --size 8GB --ranks 4  # the same node, 4 ranks
    python benchmarks/merge_bench.py --size 4GB --contenders shardforge --baseline /tmp/old  # vs. a checkout
    python benchmarks/merge_bench.py --size 4GB --contenders shardforge,shardforge_nomanifest  # the manifest
    python benchmarks/merge_bench.py --size 4GB \\
        --contenders copy,shardforge,shardforge_cast,shardforge_2ranks,shardforge_dry_run,accelerate
    python benchmarks/merge_bench.py --size 4GB --contenders shardforge \\
        --format dcp,dcp-ranks,accelerate-bin,dcp-safetensors,dcp-safetensors-consolidated

`--format` chooses how the checkpoint is saved (`bench_formats.py`: each by its trainer's own
saving API, the same model and values in each); with several, every shardforge contender runs on
every format (`shardforge@accelerate-bin`, the plain name on `dcp`), alternating with the rest,
and the ratios to the same contender on `dcp` are printed, with whether the merged weights files
are the same bytes (from each output's manifest). The peers, `copy` and `baseline` read `dcp`
only.

`--ranks 1` writes the checkpoint as a single-GPU run (or any `dcp.save` without a process group)
does: one process, whole tensors, one `__0_0.distcp` data file (written in parts of about 1 GiB,
joined into that one file). `--threads N` sets the merge's copy threads
(`SHARDFORGE_COPY_THREADS`); `--node` makes a GPU node's standard run the defaults (5 GB, one
rank, cold, 3 repeats, copy / shardforge / shardforge_nomanifest / accelerate; the copy
threads are the merge's own: the cores less one, up to 8).

`--cache cold` evicts the checkpoint's files from the page cache before every run
(posix_fadvise DONTNEED after an fsync, no root needed; not a system-wide drop_caches);
`--cache warm` reads them once first. Before every run the disk is let settle (`sync`, then
until nothing has been in flight for 1 s): the previous contender's write-back and the trims of
its removed output are not charged to the next one; then it rests `--pause` seconds (a shared
virtual disk throttles after a burst of I/O: each contender starts from the same rest).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the test helpers (tiny models, CPU ranks) live in tests/helpers/, outside the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_formats, also in spawned ranks

from bench_formats import FORMATS, checkpoint_files, make_format

UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
PART_BYTES = 1 << 30  # tensors written per dcp.save call, per part (bounds the generator's memory)
SINGLE_DATA_FILE = "__0_0.distcp"  # the one data file of a --ranks 1 checkpoint


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
    import torch.distributed.checkpoint as dcp
    from bench_formats import sharded_state

    state = sharded_state(rank, world, names, shapes, dtype)
    dcp.save({"model": state}, checkpoint_id=part_dir)  # keys `model.<fqn>`, as HF Trainer writes


def make_checkpoints(
    root: Path, size_bytes: int, dtype: str, ranks: int, formats: list[str]
) -> tuple[Path, dict[str, Path]]:
    """The bench config and, for every format, the checkpoint folder to merge (written by that
    format's own saving API, or reused): the same model, the same values."""
    from helpers.tiny import make_tokenizer

    cfg = llama_config_for(size_bytes, dtype)
    base = root / "base"
    base.mkdir(parents=True, exist_ok=True)
    (base / "config.json").write_text(json.dumps(cfg, indent=2))
    make_tokenizer().save_pretrained(base)
    ckpts = {}
    for fmt in formats:
        if fmt == "dcp":
            ckpts[fmt] = make_checkpoint(root, cfg, dtype, ranks)
        else:
            ckpts[fmt] = make_format(root, fmt, cfg, param_shapes(cfg), dtype, ranks)
    return write_bench_config(root, base), ckpts


def _write_single_part(
    part_dir: str, names: list[str], shapes: list[list[int]], dtype: str
) -> None:
    """One process, no process group: this part's whole tensors, written by dcp.save (what a
    single-GPU run and every `dcp.save` without a process group write: one `.distcp`)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from bench_formats import fill, rank_block

    block = rank_block(0, dtype)
    state: dict[str, Any] = {}
    for name, shape in zip(names, shapes, strict=True):
        state[name] = torch.empty(shape, dtype=getattr(torch, dtype))
        fill(state[name], block)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, checkpoint_id=part_dir, no_dist=True)


def _append_data_file(src: Path, dst: Path) -> int:
    """Append `src` to `dst` (created when missing); return the offset `src` starts at."""
    start = dst.stat().st_size if dst.exists() else 0
    with src.open("rb") as fin, dst.open("ab") as fout:
        shutil.copyfileobj(fin, fout, 64 << 20)
    src.unlink()
    return start


def make_checkpoint(root: Path, cfg: dict[str, Any], dtype: str, ranks: int) -> Path:
    """Write `out/checkpoint-1/pytorch_model_fsdp_0/` (DCP, in parts) unless it exists.

    `ranks` 1: each part is written by `dcp.save` in this process without a process group,
    and the parts' data files are joined into one `__0_0.distcp` (their records' offsets
    shifted in the metadata): a one-rank checkpoint of one data file, as a single-GPU run
    writes it, with the generator's memory bounded as for several ranks."""
    from torch.distributed.checkpoint.metadata import Metadata

    from helpers.dist import run_on_ranks
    from shardforge.formats.dcp.pickles import load_metadata_pickle

    ckpt = root / "out" / "checkpoint-1" / "pytorch_model_fsdp_0"
    done = ckpt / ".metadata"
    if done.exists():
        print(f"reusing checkpoint {ckpt}", file=sys.stderr)
        return ckpt
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
        names, part_shapes = [n for n, _ in part], [list(s) for _, s in part]
        if ranks == 1:
            _write_single_part(str(part_dir), names, part_shapes, dtype)
        else:
            run_on_ranks(_write_part, ranks, str(part_dir), names, part_shapes, dtype)
        # even our own file goes through the allow-list reader (torch's classes, for re-saving)
        meta = load_metadata_pickle(part_dir / ".metadata", as_torch=True)
        renames, shifts = {}, {}
        for src in part_dir.glob("*.distcp"):
            if ranks == 1:  # one data file: this part's appended to it
                renames[src.name] = SINGLE_DATA_FILE
                shifts[src.name] = _append_data_file(src, ckpt / SINGLE_DATA_FILE)
                continue
            new = src.name.replace(".distcp", f"_p{index}.distcp")
            src.rename(ckpt / new)
            renames[src.name] = new
        for info in meta.storage_data.values():
            info.offset += shifts.get(info.relative_path, 0)
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
    return ckpt


def write_bench_config(root: Path, base: Path) -> Path:
    cfg_path = root / "bench.yml"
    cfg_path.write_text(f"base_model: {base}\noutput_dir: {root / 'out'}\n")
    return cfg_path


# what --node makes the defaults: a cold one-rank checkpoint against the copy and accelerate
NODE_PROFILE: dict[str, Any] = {
    "size": "5GB",
    "ranks": 1,
    "cache": "cold",
    "repeats": 3,
    "contenders": "copy,shardforge,shardforge_nomanifest,accelerate",
}
THREADS_ENV = "SHARDFORGE_COPY_THREADS"  # io.copy.THREADS_ENV (not imported: no torch here)

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
    # argv: the checkpoint's URI, the output URI, the config, a local scratch folder
    "s3_download_merge_upload": """
        import shutil, subprocess
        from pathlib import Path
        import s3fs
        fs = s3fs.S3FileSystem()
        src, dst, cfg, scratch = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
        shutil.rmtree(scratch, ignore_errors=True)
        fs.get(src.removeprefix("s3://") + "/", str(scratch / "ckpt") + "/", recursive=True)
        subprocess.run([str(Path(sys.executable).parent / "shardforge"), "merge-sharded-fsdp-weights",
                        cfg, "--checkpoint", str(scratch / "ckpt"), "--output_path",
                        str(scratch / "out"), "--quiet", "--no-save-tokenizer"], check=True)
        fs.put(str(scratch / "out") + "/", dst.removeprefix("s3://") + "/", recursive=True)
        shutil.rmtree(scratch)
    """,
}
# the contenders that read and write object storage (a loopback SeaweedFS is started for them)
S3_CONTENDERS = ("shardforge_s3", "s3_download_merge_upload")
S3_BUCKET = "bench"


# shardforge's variants: contender name -> extra options of the merge command
SHARDFORGE_VARIANTS = {
    "shardforge": [],
    "shardforge_cast": ["--dtype", "bfloat16"],
    "shardforge_dry_run": ["--dry_run"],
}
RANKS_VARIANT = re.compile(r"^shardforge_(\d+)ranks$")
# shardforge's variants that change a module setting: contender name -> Python run before the
# command (in the same process, as `python -c`)
SHARDFORGE_PRELUDES = {
    "shardforge_nomanifest": "import shardforge.sinks.manifest as m\nm.ENABLED = False",
}
SHARDFORGE_VARIANTS["shardforge_nomanifest"] = []


def shardforge_options(name: str) -> list[str] | None:
    """The extra merge options of a shardforge contender, None for any other contender."""
    if name in SHARDFORGE_VARIANTS:
        return SHARDFORGE_VARIANTS[name]
    m = RANKS_VARIANT.match(name)
    return ["--nproc_per_node", m[1]] if m else None


def command_for(
    name: str, cfg: Path, ckpt: Path, out: Path, baseline: str = "", source: str = ""
) -> list[str]:
    merge = ["merge-sharded-fsdp-weights", str(cfg), "--checkpoint", str(ckpt),
             "--output_path", str(out), "--quiet", "--no-save-tokenizer"]  # fmt: skip
    extra = shardforge_options(name)
    env = ["env", f"PYTHONPATH={Path(source).resolve() / 'src'}"] if source else []
    if name in SHARDFORGE_PRELUDES:  # the console command's own entry, after the prelude
        code = f"{SHARDFORGE_PRELUDES[name]}\nfrom shardforge.cli.main import main\nmain()"
        return [*env, sys.executable, "-c", code, *merge]
    if extra is not None and source:  # a fixed checkout, not the (changing) working tree
        return [*env, sys.executable, "-m", "shardforge", *merge, *extra]
    if extra is not None:
        return [str(Path(sys.executable).parent / "shardforge"), *merge, *extra]
    if name == "baseline":  # another checkout's source (e.g. the previous release), same packages
        return ["env", f"PYTHONPATH={Path(baseline).resolve() / 'src'}", sys.executable, "-m",
                "shardforge", *merge]  # fmt: skip
    if name == "shardforge_s3":
        return [str(Path(sys.executable).parent / "shardforge"), "merge-sharded-fsdp-weights",
                str(cfg), "--checkpoint", f"s3://{S3_BUCKET}/ckpt", "--output_path",
                f"s3://{S3_BUCKET}/{out.name}", "--quiet", "--no-save-tokenizer"]  # fmt: skip
    if name == "s3_download_merge_upload":
        code = "import sys\n" + textwrap.dedent(PEER_SNIPPETS[name])
        return [sys.executable, "-c", code, f"s3://{S3_BUCKET}/ckpt",
                f"s3://{S3_BUCKET}/{out.name}", str(cfg), str(out)]  # fmt: skip
    if name == "copy":  # `sync FILE...` fsyncs those files only (the machine may be shared)
        return ["bash", "-c", f"cp -r '{ckpt}' '{out}' && sync '{out}'/* '{out}'/.metadata '{out}'"]
    code = "import sys\n" + textwrap.dedent(PEER_SNIPPETS[name])
    return [sys.executable, "-c", code, str(ckpt), str(out)]


@dataclass
class Result:
    seconds: list[float] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)  # the largest process (wait4)
    tree_rss: list[int] = field(default_factory=list)  # the process tree, summed (sampled)
    cpu: list[float] = field(default_factory=list)  # user + kernel CPU seconds of the tree
    load: list[float] = field(default_factory=list)  # 1-minute load average before each run
    out_bytes: int = 0
    weights_sha256: set[str] = field(default_factory=set)  # per run, from the output's manifest
    failure: str = ""


# Runs the contender from a small process, so that its peak RSS is not inflated by a fork of this
# (torch-sized) process: ru_maxrss of a child counts the memory image it had before exec
# (and is the largest single process of the tree: torchrun waits for its ranks). The summed RSS of
# the whole tree (a multi-rank merge) is sampled from /proc every 50 ms.
LAUNCHER = """
import json, os, resource, sys, time
out, limit, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
PAGE = os.sysconf("SC_PAGE_SIZE")

def tree_rss(root):
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total

t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execvp(cmd[0], cmd)
peak = 0
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    peak = max(peak, tree_rss(pid))
    time.sleep(0.05)
seconds = time.perf_counter() - t0
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
rss = usage.ru_maxrss * 1024
cpu = usage.ru_utime + usage.ru_stime
code = os.waitstatus_to_exitcode(status)
with open(out, "w") as f:
    json.dump({"seconds": seconds, "rss": rss, "tree_rss": max(peak, rss), "cpu": cpu,
               "user": usage.ru_utime, "code": code}, f)
"""


@dataclass
class Run:
    seconds: float
    rss: int  # peak RSS of the largest process
    tree_rss: int  # peak of the summed RSS of the process tree (sampled)
    cpu: float  # user + kernel CPU seconds of the process tree (its waited-for processes)
    code: int
    stderr_tail: str
    user: float = 0.0  # user CPU seconds of the process tree (its waited-for processes)


def run_one(cmd: list[str], limit_bytes: int | None, scratch: Path) -> tuple[float, int, int, str]:
    """(wall seconds, peak RSS bytes, exit status, stderr tail) of one contender process."""
    run = run_measured(cmd, limit_bytes, scratch)
    return run.seconds, run.rss, run.code, run.stderr_tail


def run_measured(cmd: list[str], limit_bytes: int | None, scratch: Path) -> Run:
    """Wall seconds, peak RSS, exit status and stderr tail of one contender (process tree)."""
    report = scratch / "run.json"
    launcher = [sys.executable, "-S", "-c", LAUNCHER, str(report), str(limit_bytes or 0)]
    proc = subprocess.run(
        launcher + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False
    )
    err = proc.stderr.decode(errors="replace")
    r = json.loads(report.read_text())
    return Run(r["seconds"], r["rss"], r["tree_rss"], r["cpu"], r["code"], err[-600:], r["user"])


def weights_digest(out: Path) -> str:
    """One SHA-256 over the output's weights files' names and digests, from the merge's
    manifest ("" without one), prefixed with the manifest's hash (version 1 has none: SHA-256):
    equal values mean byte-identical weights files; manifests of two hashes never compare
    equal (regress.py compares the bytes themselves)."""
    import hashlib

    manifest = out / "shardforge-manifest.json"
    if not manifest.is_file():
        return ""
    doc = json.loads(manifest.read_text())
    algo = doc.get("hash", "sha256")
    files = doc["files"]
    weights = sorted((n, f[algo]) for n, f in files.items() if n.endswith(".safetensors"))
    return f"{algo}:" + hashlib.sha256(json.dumps(weights).encode()).hexdigest()


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


def disk_stat(path: Path) -> list[int] | None:
    """The block device counters (/sys/dev/block/M:m/stat) of the disk holding `path`."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    try:
        return [int(x) for x in stat.read_text().split()]
    except (OSError, ValueError):
        return None


def settle(path: Path, quiet_s: float = 1.0, limit_s: float = 60.0) -> float:
    """Wait until the disk holding `path` has been idle for `quiet_s` (nothing in flight, no
    request finished): the previous run's write-back, and the discards of its removed output
    (a filesystem mounted with `discard` trims them after the run), must not be charged to the
    next contender. Returns the seconds waited."""
    os.sync()
    start = time.monotonic()
    last, since = disk_stat(path), time.monotonic()
    if last is None:
        return 0.0
    while time.monotonic() - start < limit_s:
        time.sleep(0.1)
        now = disk_stat(path)
        assert now is not None
        busy = now[8] != 0 or now[:8] + now[11:15] != last[:8] + last[11:15]
        if busy:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return time.monotonic() - start


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
    parser.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="ranks writing the checkpoint (1: one process without a process group, one "
        ".distcp data file, as a single-GPU run writes it)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the merge's copy threads (SHARDFORGE_COPY_THREADS for the shardforge "
        "contenders; default: what the merge sizes itself, io.copy.copy_threads)",
    )
    parser.add_argument(
        "--node",
        action="store_true",
        help="a GPU node's standard run in one command: the defaults become "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in NODE_PROFILE.items())
        + " (the copy threads: the merge's own, the cores less one up to 8); options given "
        "still win",
    )
    parser.add_argument(
        "--format",
        default="dcp",
        help="how the checkpoint is saved, comma-separated for several (the same model in each; "
        f"the shardforge contenders run on every one, as NAME@FORMAT): {', '.join(FORMATS)}",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--contenders",
        default="copy,shardforge,shardforge_cast,shardforge_2ranks,shardforge_dry_run,"
        "accelerate,dcp_to_torch_save",
        help="comma-separated; shardforge_Nranks for any N",
    )
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold")
    parser.add_argument(
        "--pause",
        type=float,
        default=5.0,
        help="seconds of rest for the disk before every run, after it settled (a shared "
        "virtual disk throttles after a burst; every contender starts from the same rest)",
    )
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
    parser.add_argument(
        "--source",
        default="",
        help="run the shardforge contenders from this checkout's src/ (e.g. a `git worktree` "
        "of the commit measured) instead of the installed package",
    )
    if "--node" in sys.argv[1:]:
        parser.set_defaults(**NODE_PROFILE)
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads: at least 1")
        os.environ[THREADS_ENV] = str(args.threads)

    size = parse_size(args.size)
    root = Path(args.workdir).resolve() / f"llama-{args.size}-{args.dtype}-{args.ranks}r"
    print(
        f"making a {human(size)} {args.dtype} checkpoint on {args.ranks} ranks in {root}",
        file=sys.stderr,
    )
    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    if not formats or set(formats) - set(FORMATS):
        parser.error(f"--format: one or more of {', '.join(FORMATS)}, comma-separated")
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if args.baseline and "baseline" not in contenders:
        contenders.append("baseline")
    unknown = [
        n for n in contenders if shardforge_options(n) is None and n not in (*PEERS, "baseline")
    ]
    if unknown:
        parser.error(f"unknown contender(s) {', '.join(unknown)}")
    names = run_labels(contenders, formats)
    if not names:
        parser.error("no contender runs on these formats (the peers, copy and baseline: dcp only)")
    cfg, ckpts = make_checkpoints(root, size, args.dtype, args.ranks, formats)
    files = {fmt: checkpoint_files(root, fmt) for fmt in formats}
    fmt_bytes = {fmt: sum(p.stat().st_size for p in fs) for fmt, fs in files.items()}
    ckpt_bytes = fmt_bytes[formats[0]]
    results = {n: Result() for n in names}
    peer_limit = parse_size(args.peer_mem_limit) if args.peer_mem_limit else None
    store = start_store(root, ckpts["dcp"]) if any(n in S3_CONTENDERS for n in names) else None
    for n in names:
        m = RANKS_VARIANT.match(n)
        if m and int(m[1]) > (os.cpu_count() or 1):
            print(f"note: {n} runs {m[1]} ranks on {os.cpu_count()} cores", file=sys.stderr)
    if "shardforge_cast" in names and args.dtype == "bfloat16":
        print("note: shardforge_cast of a bfloat16 checkpoint casts nothing", file=sys.stderr)

    def report() -> dict[str, Any]:
        table = summarize(results, ckpt_bytes, len(files[formats[0]]) - 1, args)
        table["formats"] = {
            fmt: {"folder": str(ckpts[fmt]), "bytes": fmt_bytes[fmt], "files": len(files[fmt])}
            for fmt in formats
        }
        return table

    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # alternate who goes first
        for name in order:
            res = results[name]
            if res.failure:
                continue
            contender, fmt = split_label(name)
            out = root / f"merged-{name}"
            shutil.rmtree(out, ignore_errors=True)
            (evict if args.cache == "cold" else warm)(files[fmt])
            settle(root)
            time.sleep(args.pause)
            ours = shardforge_options(contender) is not None or name in ("baseline", "copy")
            limit = None if ours else peer_limit
            cmd = command_for(contender, cfg, ckpts[fmt], out, args.baseline, args.source)
            load = os.getloadavg()[0]
            run = run_measured(cmd, limit, root)
            if run.code != 0:
                err = run.stderr_tail.strip()
                res.failure = f"exit {run.code}: {err.splitlines()[-1] if err else ''}"
                print(f"  {name}: FAILED ({res.failure})", file=sys.stderr)
            else:
                res.seconds.append(run.seconds)
                res.peak_rss.append(run.rss)
                res.tree_rss.append(run.tree_rss)
                res.cpu.append(run.cpu)
                res.load.append(load)
                res.out_bytes = (
                    stored_bytes(store, out) if name in S3_CONTENDERS else dir_bytes(out)
                )
                if digest := weights_digest(out):
                    res.weights_sha256.add(digest)
                print(
                    f"  run {rep + 1} {name}: {run.seconds:.2f} s, CPU {run.cpu:.2f} s, peak RSS "
                    f"{human(run.rss)} (tree {human(run.tree_rss)}), load before {load:.2f}",
                    file=sys.stderr,
                )
            shutil.rmtree(out, ignore_errors=True)
            stored = f"{S3_BUCKET}/{out.name}"  # a failed merge wrote nothing there
            if store is not None and name in S3_CONTENDERS and store.fs().exists(stored):
                store.fs().rm(stored, recursive=True)
                store.vacuum()  # the server's volumes would fill the disk run by run
            if args.json:  # after every run: a long session that is cut off keeps its numbers
                Path(args.json).write_text(json.dumps(report(), indent=2))

    table = report()
    for fmt in formats:
        print(f"\ncheckpoint {fmt}: {human(fmt_bytes[fmt])} {args.dtype}, {len(files[fmt])} "
              f"files, {args.ranks} ranks", end="")  # fmt: skip
    threads = f"{args.threads} copy threads" if args.threads else "copy threads: the merge's own"
    print(f"\ncache: {table['cache']}; repeats: {args.repeats}; "
          f"{os.cpu_count()} cores, {threads}; disk settled + {args.pause:g} s rest before every run")  # fmt: skip
    w = max(22, *(len(n) + 2 for n in names))
    print(f"{'contender':<{w}}{'median s':>10}{'best s':>8}{'CPU s':>7}{'MB/s':>8}{'peak RSS':>11}"
          f"{'RSS/ckpt':>10}{'tree RSS':>11}{'output':>11}{'/copy':>8}{'load':>7}")  # fmt: skip
    for name, row in table["results"].items():
        if "median_s" not in row:
            print(f"{name:<{w}}{'failed: ' + row['failure'] if row['failure'] else 'no runs'}")
            continue
        vs_copy = f"{row['copy_time_ratio']:.2f}x" if "copy_time_ratio" in row else "-"
        print(f"{name:<{w}}{row['median_s']:>10.2f}{row['best_s']:>8.2f}{row['median_cpu_s']:>7.1f}"
              f"{fmt_bytes[split_label(name)[1]] / row['median_s'] / 1e6:>8.0f}"
              f"{human(row['peak_rss']):>11}"
              f"{row['peak_rss'] / fmt_bytes[split_label(name)[1]]:>10.1%}"
              f"{human(row['tree_rss']):>11}{human(row['output_bytes']):>11}{vs_copy:>8}"
              f"{row['median_load']:>7.2f}")  # fmt: skip
    for line in table["ratios"]:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    if store is not None:
        store.stop()


def start_store(root: Path, ckpt: Path) -> Any:
    """A SeaweedFS on loopback holding the checkpoint at s3://bench/ckpt; the contenders find
    it through the AWS variables of this process's environment."""
    from helpers.s3 import start_server

    shutil.rmtree(root / "s3", ignore_errors=True)
    store = start_server(root / "s3", volume_size_mb=1024)
    os.environ.update(store.env({}))
    store.bucket(S3_BUCKET)
    print(f"uploading the checkpoint to s3://{S3_BUCKET}/ckpt ({store.endpoint})", file=sys.stderr)
    store.fs().put(str(ckpt) + "/", f"{S3_BUCKET}/ckpt/", recursive=True)
    return store


def stored_bytes(store: Any, out: Path) -> int:
    fs = store.fs()
    return int(sum(fs.du(f"{S3_BUCKET}/{out.name}", total=False).values()))


PEERS = (*PEER_SNIPPETS, "copy", "shardforge_s3")


def run_labels(contenders: list[str], formats: list[str]) -> list[str]:
    """The runs of one repeat: every shardforge contender on every format (``NAME@FORMAT``,
    the plain name on ``dcp``); the peers, copy and baseline on ``dcp`` only."""
    labels = []
    for fmt in formats:
        for name in contenders:
            if fmt == "dcp":
                labels.append(name)
            elif shardforge_options(name) is not None:
                labels.append(f"{name}@{fmt}")
    return labels


def split_label(label: str) -> tuple[str, str]:
    """(contender, format) of a run label."""
    name, _, fmt = label.partition("@")
    return name, fmt or "dcp"


def summarize(
    results: dict[str, Result], ckpt_bytes: int, n_files: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Medians, peaks and the ratios the issue's targets are stated in."""
    cache = (
        "cold (checkpoint files evicted with posix_fadvise(DONTNEED) before every run)"
        if args.cache == "cold"
        else "warm (checkpoint files read once before every run)"
    )
    table: dict[str, Any] = {
        "checkpoint_bytes": ckpt_bytes,
        "files": n_files,
        "dtype": args.dtype,
        "cache": cache,
        "cores": os.cpu_count(),
        "copy_threads": os.environ.get(THREADS_ENV, "the merge's own"),
        "ranks": args.ranks,
        "pause_s": args.pause,
        "source": args.source or "installed package",
        "results": {},
        "ratios": [],
    }
    med = {n: statistics.median(r.seconds) for n, r in results.items() if r.seconds}
    for name, res in results.items():
        if not res.seconds:
            table["results"][name] = {"failure": res.failure}
            continue
        row: dict[str, Any] = {
            "median_s": med[name],
            "best_s": min(res.seconds),
            "runs_s": res.seconds,
            "peak_rss": max(res.peak_rss),
            "tree_rss": max(res.tree_rss),
            "runs_cpu_s": res.cpu,
            "median_cpu_s": statistics.median(res.cpu),
            "loads": res.load,
            "median_load": statistics.median(res.load),
            "output_bytes": res.out_bytes,
            "weights_sha256": sorted(res.weights_sha256),
        }
        if "copy" in med and name != "copy":
            row["copy_time_ratio"] = med[name] / med["copy"]
        if "shardforge" in med and name != "shardforge":
            row["shardforge_time_ratio"] = med["shardforge"] / med[name]
        table["results"][name] = row
    lines = table["ratios"]
    if "shardforge" in med:
        for name in med:
            if name in PEERS and name != "copy":
                lines.append(
                    f"{name} / shardforge: {med[name] / med['shardforge']:.2f}x the time "
                    "(above 1: shardforge is faster)"
                )
    for name in med:
        if name != "copy" and "copy" in med:
            lines.append(f"{name} / copy: {med[name] / med['copy']:.2f}x the time")
    for name in med:
        contender, fmt = split_label(name)
        if fmt != "dcp" and contender in med:
            mine, theirs = results[name].seconds, results[contender].seconds
            paired = ", ".join(f"{a / b:.2f}" for a, b in zip(mine, theirs, strict=False))
            digests = results[name].weights_sha256 | results[contender].weights_sha256
            same = "; same weights bytes as on dcp" if len(digests) == 1 else ""
            lines.append(
                f"{name} / {contender}: {med[name] / med[contender]:.2f}x the time ({fmt} "
                f"against dcp; best runs {min(mine) / min(theirs):.2f}x; repeat by repeat "
                f"{paired}{same})"
            )
    if "shardforge" in med:
        for name in med:
            if name.startswith("shardforge_") or name == "baseline":
                lines.append(f"{name} / shardforge: {med[name] / med['shardforge']:.2f}x the time")
    return table


if __name__ == "__main__":
    main()
