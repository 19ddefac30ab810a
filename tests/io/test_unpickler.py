"""The allow-list unpickler's engine (`shardforge.io.unpickler`): its rules on a profile of
its own, and one hostile corpus (`helpers.hostile`) refused by every entry point that reads a
checkpoint pickle (merge of DCP `.metadata`, chunk records and rank files; inspect; `--engine
transformers`; resume): one clean line, fast, within bounded memory, no payload run, no torch
class changed. Each format's profile is tested beside its format (tests/formats/)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from helpers.dcp_metadata import CRAFTED
from helpers.hostile import check_refusal, class_snapshot, hostile_corpus, refuses_the_corpus
from shardforge.errors import CheckpointError
from shardforge.io.unpickler import (
    BYTES_PER_MEMO,
    MAX_MEMORY,
    MEMORY_PER_BYTE,
    Profile,
    Record,
    record_class,
    unpickle,
)

BARE = Profile("tests", {}, max_bytes=1 << 20, max_memo=1 << 10)


def test_names_from_the_pickle_are_sanitized() -> None:
    evil = "\x1b]0;pwned\x07\x1b[31m" + "A" * 500
    data = b"\x80\x02c" + f"{evil}\nsystem\n".encode() + b"."
    with pytest.raises(CheckpointError) as info:
        unpickle(data, "f.pkl", BARE)
    message = str(info.value)
    check_refusal(message, "escape")
    assert "\x1b" not in message and len(message) < 300 and "?]0;pwned??[31mAAA" in message


Thing = record_class("Thing", __name__, "A record of the tests' own profile.")
THINGS = Profile("things", {("some.module", "Thing"): Thing}, max_bytes=1 << 10, max_memo=8)


def test_state_cannot_shadow_methods_or_dunders() -> None:
    # NEWOBJ a record, BUILD it with state naming its method and a dunder
    payload = (
        b"\x80\x02csome.module\nThing\n)\x81}(X\x03\x00\x00\x00get"
        b"K\x01X\t\x00\x00\x00__class__K\x02X\x07\x00\x00\x00versionX\x01\x00\x00\x001ub."
    )
    rec = unpickle(payload, "f", THINGS)
    assert type(rec) is Thing and isinstance(rec, Record) and rec.version == "1"
    assert callable(rec.get) and rec.get("get") == 1
    with pytest.raises(AttributeError):
        rec.__deepcopy__  # noqa: B018
    assert (Thing.__module__, Thing.__name__, Thing.__slots__) == (__name__, "Thing", ())


def test_only_allow_listed_names_are_called_and_built(tmp_path: Path) -> None:
    assert unpickle(pickle.dumps({"a": [1, (2.5, None)], 3: b"x"}), "f", BARE) == {
        "a": [1, (2.5, None)],
        3: b"x",
    }
    marker = tmp_path / "MARKER"
    for data, message in (
        (pickle.dumps(os.system), r"references posix\.system, which is not on the allow-list"),
        (pickle.dumps(torch.float16), None),  # dtypes: in every profile
        (b"\x80\x02ctorch\nfloat16\n)R.", r"calls a dtype \(torch\.float16\), which is not on"),
        (b"\x80\x02csome.module\nThing\n)\x81]b.", r"gives a list as the state of Thing"),
        (b"\x80\x02}]b.", r"sets the state of a dict, which is not allowed"),
        (b"\x80\x02K\x01K\x02a.", r"appends to a int, which is not a list"),
        (b"\x80\x02}]Ns.", r"uses a list as a dictionary key"),
        (b"\x80\x02X\x01\x00\x00\x00aQ.", r"persistent reference, which things never do"),
    ):
        if message is None:
            assert unpickle(data, "f", THINGS) is torch.float16
            continue
        with pytest.raises(CheckpointError, match=message):
            unpickle(data, "f", THINGS)
    assert not marker.exists()


def test_input_and_memo_limits() -> None:
    small = Profile("tests", {}, max_bytes=8, max_memo=3)
    assert unpickle(b"\x80\x04N\x94\x94\x94.", "f", small) is None
    with pytest.raises(CheckpointError, match="memo index 3"):
        unpickle(b"\x80\x04N\x94\x94\x94\x94.", "f", small)
    with pytest.raises(CheckpointError, match="the pickle is 9 bytes; tests are at most 8"):
        unpickle(b"\x80\x04N\x94\x94\x94\x94..", "f", small)


# a profile whose own caps are far away: only the budget by the input's size can refuse
ROOMY = Profile("roomy", {}, max_bytes=1 << 30, max_memo=1 << 26)


def memo_bomb(entries: int) -> bytes:
    """None memoized and popped `entries` times: 3 bytes per memo entry (the 90 MB .metadata
    of 30 million entries was this)."""
    return b"\x80\x04" + b"N\x940" * entries + b"N."


def test_the_memo_is_bounded_by_the_input_size() -> None:
    data = memo_bomb(200_000)
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as info:
        unpickle(data, "bomb.pkl", ROOMY)
    assert time.perf_counter() - start < 10  # refused at a quarter of the file, not its end
    assert str(info.value).startswith(
        f"bomb.pkl: refused to load: the pickle has a memo that exceeds {len(data) // 4} entries "
        f"for a file of {len(data)} bytes"
    ), str(info.value)
    # a real pickle memoizes about one object per 10 bytes: far below the budget
    real = pickle.dumps([f"name.{i}" for i in range(50_000)], protocol=4)
    assert unpickle(real, "real.pkl", ROOMY)[-1] == "name.49999"
    # a memo index far beyond what the file could fill is refused before anything is stored
    with pytest.raises(CheckpointError, match="memo that exceeds 4096 entries for a file of 9"):
        unpickle(b"\x80\x04Nr\x00\x00\x01\x00.", "f", ROOMY)


def test_the_objects_built_are_bounded_by_the_input_size() -> None:
    """Empty sets appended to a list (232 bytes each from 2 bytes of pickle) are refused once
    they exceed `MEMORY_PER_BYTE` bytes per byte of the file; the same number of small lists
    is fine."""
    data = b"\x80\x04]" + b"\x8fa" * 100_000 + b"."
    with pytest.raises(CheckpointError) as info:
        unpickle(data, "sets.pkl", ROOMY)
    budget = len(data) * MEMORY_PER_BYTE
    assert f"builds more than {budget} bytes of objects from {len(data)} bytes" in str(info.value)
    lists = pickle.dumps([[i] for i in range(300, 100_300)], protocol=4)
    assert len(unpickle(lists, "lists.pkl", ROOMY)) == 100_000


# crafted .metadata files by their size in bytes (`helpers.dcp_metadata.CRAFTED`: memoized, kept
# in containers, nested, or nothing kept; benchmarks/metadata_bound.py runs them at the cap)
CASES: dict[str, Callable[[int], bytes]] = CRAFTED


def _cost(data: bytes, profile: Profile, traced: bool) -> float:
    """CPU seconds to read or refuse `data` (or, traced, the peak bytes of Python objects
    beyond the file itself)."""
    import tracemalloc

    if traced:
        tracemalloc.start()
    start = time.process_time()
    with contextlib.suppress(CheckpointError):
        unpickle(data, "crafted.metadata", profile)
    spent = time.process_time() - start
    if not traced:
        return spent
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_crafted_metadata_costs_a_small_bounded_memory_and_time_per_byte(name: str) -> None:
    """Measured at a size that runs in a fraction of a second: memory per byte of the file is
    the budget's (plus the memo's 8 bytes an entry), and time grows linearly (a quadratic one,
    as the garbage collector's passes over every container built made it, quadruples when the
    file doubles), small enough that a file at the cap is read or refused in seconds."""
    from shardforge.formats.dcp.pickles import METADATA

    small, large = CASES[name](300_000), CASES[name](600_000)
    per_byte = _cost(large, METADATA, traced=True) / len(large)
    assert per_byte <= 1.3 * MEMORY_PER_BYTE + 8 / BYTES_PER_MEMO, (name, per_byte)
    times = [min(_cost(d, METADATA, False) for _ in range(3)) / len(d) for d in (small, large)]
    assert times[1] <= 2 * times[0] + 50e-9, (name, times)  # linear
    # the cap, at this machine's speed (twice the 10 s target: a loaded CI machine)
    assert times[1] * METADATA.max_bytes <= 20, (name, times[1] * 1e9, "ns per byte")


def test_a_crafted_metadata_at_the_cap_stays_under_1_gb() -> None:
    """Whatever its size, a pickle builds at most `MAX_MEMORY` bytes of objects (shown with a
    small one) and memoizes at most `max_memo` entries: at the .metadata cap that is under
    1 GB with the file itself."""
    from shardforge.formats.dcp.pickles import METADATA

    data = CRAFTED["memoized sets"](3_000_000)  # 232 bytes kept per 3 bytes of file
    small = Profile("tests", {}, max_bytes=1 << 30, max_memo=1 << 26)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("shardforge.io.unpickler.MAX_MEMORY", 4 << 20)
        with pytest.raises(CheckpointError, match=r"and 4 MiB in all"):
            unpickle(data, "crafted.metadata", small)
        assert _cost(data, small, traced=True) <= 1.3 * (4 << 20) + 2 * len(data)
    worst = 1.3 * MAX_MEMORY + 8 * METADATA.max_memo + METADATA.max_bytes
    assert worst < 1e9, worst


def test_a_bare_profile_refuses_the_corpus(tmp_path: Path) -> None:
    refuses_the_corpus(BARE, tmp_path)


# -- the corpus, every entry point ---------------------------------------------------------------

MODEL_KEY = "model.norm.weight"


def _trainer_state() -> dict[str, Any]:
    from shardforge.train.checkpointing import TrainerState

    return asdict(TrainerState(1, 1, 4, 4, 8, 0))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model, a checkpoint of it in shardforge's layout (model, optimizer, trainer
    state: mergeable and resumable) and in LMMs-Engine's rank-file layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import AutoModelForCausalLM

    from helpers.tiny import make_model

    root = tmp_path_factory.mktemp("corpus")
    base = make_model(root / "base", "llama", vocab_size=320)
    model = AutoModelForCausalLM.from_pretrained(base)
    ckpt = root / "run" / "checkpoint-1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(model.state_dict(), checkpoint_id=ckpt / "model", no_dist=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        dcp.save(
            get_optimizer_state_dict(model, opt), checkpoint_id=ckpt / "optimizer", no_dist=True
        )
    (ckpt / "trainer_state.json").write_text(json.dumps(_trainer_state()))
    torch.save({"python": 0}, ckpt / "rng_state_0.pt")
    ranks = root / "ranks" / "checkpoint-3" / "pytorch_model_fsdp_0"
    ranks.mkdir(parents=True)
    torch.save(model.state_dict(), ranks / "model_world_size_1_rank_0.pt")
    _zip_bomb(root / "rank_bomb.pt", "model_world_size_1_rank_0/data.pkl")
    _zip_bomb(root / "record_bomb.pt", "archive/data.pkl")
    return root


def _torch_zip(path: Path, data_pkl: bytes, storage: bytes) -> None:
    """A torch.save archive written by torch's own zip writer, holding `data_pkl`."""
    writer = torch._C.PyTorchFileWriter(str(path))
    writer.write_record("data.pkl", data_pkl, len(data_pkl))
    writer.write_record("byteorder", b"little", 6)
    writer.write_record("data/0", storage, len(storage))
    writer.write_end_of_file()


def _zip_bomb(path: Path, member: str, size: int = 128 << 20) -> None:
    """A zip whose `member` is `size` bytes deflated into about 600 KiB."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open(member, "w", force_zip64=True) as f:
            block = bytes(1 << 20)
            for _ in range(size >> 20):
                f.write(block)
        zf.writestr(member.replace("data.pkl", "data/0"), bytes(64), zipfile.ZIP_STORED)


class Env:
    """A private copy of the pristine checkpoints; each `put_*` plants one payload."""

    def __init__(self, pristine: Path, root: Path) -> None:
        self.root = root
        shutil.copytree(pristine / "run", root / "run")
        shutil.copytree(pristine / "ranks", root / "ranks")
        self.base = pristine / "base"
        self.bombs = pristine
        self.ckpt = root / "run" / "checkpoint-1"
        self.model = self.ckpt / "model"
        self.rank_dir = root / "ranks" / "checkpoint-3" / "pytorch_model_fsdp_0"
        self.rank_file = self.rank_dir / "model_world_size_1_rank_0.pt"
        self.meta = self.model / ".metadata"
        self.original_meta = self.meta.read_bytes()
        self.distcp = self.model / "__0_0.distcp"
        self.original_distcp = self.distcp.read_bytes()
        self.cfg = root / "cfg.yml"
        self.cfg.write_text(json.dumps({"base_model": str(self.base), "output_dir": str(root)}))

    def put_metadata(self, data: bytes) -> Path:
        self.meta.write_bytes(data)
        return self.meta

    def put_record(self, data_pkl: bytes, bomb: bool = False) -> Path:
        """Append a record holding `data_pkl` to the .distcp and point MODEL_KEY's chunk at it
        (the .metadata is our own test file: pickle is fine here)."""
        meta = pickle.loads(self.original_meta)
        index = next(i for i in meta.storage_data if i.fqn == MODEL_KEY)
        record = self.root / "record.pt"
        if bomb:
            shutil.copy(self.bombs / "record_bomb.pt", record)
        else:
            _torch_zip(record, data_pkl, bytes(256))
        blob = record.read_bytes()
        info = meta.storage_data[index]
        info.offset, info.length = len(self.original_distcp), len(blob)
        self.meta.write_bytes(pickle.dumps(meta))
        self.distcp.write_bytes(self.original_distcp + blob)
        return self.distcp

    def put_rank_file(self, data_pkl: bytes, bomb: bool = False) -> Path:
        self.rank_file.unlink()
        if bomb:
            shutil.copy(self.bombs / "rank_bomb.pt", self.rank_file)
        else:
            _torch_zip(self.rank_file, data_pkl, bytes(256))
        return self.rank_file

    def tree(self) -> str:
        h = hashlib.sha256()
        for p in sorted(self.root.rglob("*")):
            h.update(str(p.relative_to(self.root)).encode())
            if p.is_file():
                h.update(p.read_bytes())
        return h.hexdigest()


def _cli(*args: str | Path) -> str:
    """Run the CLI in-process; it must fail with exactly one clean `error:` line: return it."""
    from shardforge.cli.main import cli

    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert "Traceback" not in result.output
    return errors[0]


def _merge(env: Env, *extra: str) -> str:
    out = env.root / "out"
    args = ["merge-sharded-fsdp-weights", env.cfg, "--output_path", out, "--quiet", *extra]
    line = _cli(*args)
    assert not out.exists()
    return line


def _merge_model(env: Env) -> str:
    return _merge(env, "--checkpoint", str(env.model))


def _merge_ranks(env: Env) -> str:
    return _merge(env, "--checkpoint", str(env.rank_dir))


def _engine_transformers(env: Env) -> str:
    return _merge(env, "--checkpoint", str(env.model), "--engine", "transformers")


def _torch_reader(env: Env) -> str:
    """The torch-class mode, as `SafeFileSystemReader` uses it for torch's DCP loader."""
    from shardforge.formats.dcp.reader import read_dcp_metadata

    with pytest.raises(CheckpointError) as info:
        read_dcp_metadata(env.model)
    return str(info.value)


def _resume(env: Env) -> str:
    """Training's resume: the explicit-path check (`.metadata` and every record's structure),
    then `load_checkpoint` itself (torch's DCP loader through `CheckedFileSystemReader`)."""
    from shardforge.train.checkpointing import load_checkpoint, resolve_resume

    with pytest.raises(CheckpointError) as checked:
        resolve_resume(str(env.ckpt), env.root)
    check_refusal(str(checked.value), "resolve_resume")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(env.base)  # what the checkpoint holds
    with pytest.raises(CheckpointError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_checkpoint(env.ckpt, model, torch.optim.AdamW(model.parameters(), lr=0.0))
    return str(info.value)


# entry point -> (where the payload goes, how the entry point is run)
ENTRY_POINTS: dict[str, tuple[str, Callable[[Env], str]]] = {
    "merge .metadata": ("metadata", _merge_model),
    "merge chunk record": ("record", _merge_model),
    "merge rank file": ("rank file", _merge_ranks),
    "inspect .metadata": ("metadata", lambda env: _cli("inspect", env.model)),
    "inspect rank file": ("rank file", lambda env: _cli("inspect", env.rank_dir)),
    "merge --engine transformers": ("metadata", _engine_transformers),
    "torch's DCP reader": ("metadata", _torch_reader),
    "resume": ("metadata", _resume),
    "resume chunk record": ("record", _resume),
    "merge --engine transformers chunk record": ("record", _engine_transformers),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_refuses_the_corpus(entry: str, pristine: Path, tmp_path: Path) -> None:
    env = Env(pristine, tmp_path / "env")
    marker = tmp_path / "MARKER"
    where, run = ENTRY_POINTS[entry]
    put = {"metadata": env.put_metadata, "record": env.put_record, "rank file": env.put_rank_file}
    before = class_snapshot()
    for name, data in hostile_corpus(marker).items():
        path = put[where](data)
        tree = env.tree()
        start = time.perf_counter()
        line = run(env)
        assert time.perf_counter() - start < 10, (entry, name)
        check_refusal(line, name)
        assert path.name in line, (entry, name, line)
        assert not marker.exists(), (entry, name)
        assert env.tree() == tree, (entry, name)  # nothing written, nothing removed
    assert class_snapshot() == before


# -- memory: the bombs in a fresh process ---------------------------------------------------------

_MEMORY_SCRIPT = r"""
import json, resource, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[4])
from test_unpickler import Env, _merge, hostile_corpus

env = Env(Path(sys.argv[2]), Path(sys.argv[3]) / "env")
corpus = hostile_corpus(Path(sys.argv[3]) / "MARKER")
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cases = {
    ".metadata " + name: (lambda d=data: env.put_metadata(d), env.model)
    for name, data in corpus.items()
    if "memo" in name or "8 of" in name or "nested" in name or "MARK" in name
}
cases["zip bomb rank file"] = (lambda: env.put_rank_file(b"", bomb=True), env.rank_dir)
cases["zip bomb chunk record"] = (lambda: env.put_record(b"", bomb=True), env.model)
# warm up: the same code paths once (a truncated pickle), so imports are not counted
for where in ("metadata", "record", "rank"):
    getattr(env, "put_" + {"rank": "rank_file"}.get(where, where))(corpus["truncated"])
    _merge(env, "--checkpoint", str(env.rank_dir if where == "rank" else env.model))
base = peak()
times, lines = {}, {}
for name, (put, checkpoint) in cases.items():
    put()
    start = time.perf_counter()
    lines[name] = _merge(env, "--checkpoint", str(checkpoint))
    times[name] = time.perf_counter() - start
print(json.dumps({"extra": peak() - base, "times": times, "lines": lines}))
"""


def test_bombs_stay_within_100_mb(pristine: Path, tmp_path: Path) -> None:
    """Memo, length, nesting and zip bombs (128 MiB deflated into about 600 KiB) through
    the merge, in a fresh process: each is one line within seconds, and peak memory grows by
    less than 100 MB over all of them."""
    assert (pristine / "rank_bomb.pt").stat().st_size < 2 << 20
    script = [sys.executable, "-c", _MEMORY_SCRIPT, str(Path(__file__).parent)]
    proc = subprocess.run(
        [*script, str(pristine), str(tmp_path), str(Path(__file__).parents[1])],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["extra"] < 100 << 20, found
    assert max(found["times"].values()) < 5, found["times"]
    assert {"zip bomb rank file", "zip bomb chunk record"} < set(found["lines"]), found
    for name, line in found["lines"].items():
        check_refusal(line, name)
        if "zip bomb" in name:
            assert "compressed" in line, line
    assert not (tmp_path / "MARKER").exists()
