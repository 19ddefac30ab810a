"""Seeded fuzzing of a real `.metadata`, a real `.distcp`, a real rank file and a rank file of a
2-D FSDP2 + TP mesh (strided shards, sub-mesh copies): a few hundred byte flips and
truncations, each read in-process through every tensor's source, with every stored record's
CRC-32 checked (and every copy of a replicated piece compared). Every outcome is a clean `ShardforgeError` or tensors
bit-identical to the original's; nothing else is raised and nothing hangs.

A flip may also rename a key of `.metadata` (the read then succeeds with other names); such
cases, and a sample of the others, go through the whole merge (`merge_fsdp_weights(...,
verify=True)`, whose verification checks the CRC-32s too), which must refuse or write an
output identical to the original merge.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers.meshes import mesh_rank_files
from shardforge.errors import ShardforgeError
from shardforge.formats.dcp.chunks import locate, read_full
from shardforge.formats.dcp.metadata import read_metadata
from shardforge.formats.rankfiles.rank_file import read_rank_file
from shardforge.formats.rankfiles.rank_plan import list_rank_files, plan_from_files
from shardforge.formats.rankfiles.source import RankFileSource
from shardforge.io.copy import ReadCache
from shardforge.io.zip_record import check_crc
from shardforge.merge.api import merge_fsdp_weights
from test_inspection import LMMS_STEP, WORLD, Built, build_checkpoints

# the checkpoints are written by gloo ranks (build_checkpoints)
pytestmark = pytest.mark.slow

SEED = 20240610
CASES = {"metadata": 100, "distcp": 80, "rank": 90, "rank2d": 60}  # mutations per target
FULL_MERGES = 3  # per target: cases also run through the whole merge

Tensors = dict[str, torch.Tensor]


def read_dcp(ckpt: Path) -> Tensors:
    """Every tensor of a DCP directory through the merge's reader; every record's CRC-32."""
    meta = read_metadata(ckpt)
    out = {}
    with ReadCache() as reader:
        for key, entry in meta.tensors.items():
            for chunk in entry.chunks:
                fd, raw = locate(reader, chunk)
                if raw is not None:
                    check_crc(fd, raw.storage, str(chunk.file))
            out[key] = read_full(reader, entry)
    return out


def read_ranks(folder: Path) -> Tensors:
    """Every full tensor of a rank-file folder through its sources; every record's CRC-32."""
    files = [read_rank_file(p) for p in list_rank_files(folder).values()]
    plans = plan_from_files(files)
    with ReadCache() as reader:
        for rf in files:
            for rec in rf.tensors.values():
                check_crc(reader.fd(rec.path), rec.storage, str(rec.path))
        return {key: RankFileSource(plan).read(reader) for key, plan in plans.items()}


def same(a: Tensors, b: Tensors) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def same_names(a: Tensors, b: Tensors) -> bool:
    return a.keys() == b.keys() and all(
        (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape) for k in a
    )


def payload_ranges(ckpt: Path, path: Path) -> list[tuple[int, int]]:
    """Byte ranges of `path` holding tensor storage (changes there only a CRC can see)."""
    with ReadCache() as reader:
        if path.suffix == ".distcp":
            chunks = [c for e in read_metadata(ckpt).tensors.values() for c in e.chunks]
            raws = [locate(reader, c)[1] for c in chunks if c.file == path]
            return [(r.storage.data_offset, r.storage.data_end) for r in raws if r is not None]
    recs = read_rank_file(path).tensors.values()
    return [(r.storage.data_offset, r.storage.data_end) for r in recs]


def mutations(data: bytes, payload: list[tuple[int, int]], n: int, rng: random.Random) -> list:
    """(kind, position, value): flips (half of them outside tensor payload) and truncations."""
    in_payload = bytearray(len(data))
    for start, end in payload:
        in_payload[start:end] = b"\1" * (end - start)
    structure = [i for i in range(len(data)) if not in_payload[i]]
    out: list[tuple[str, int, int]] = []
    for i in range(n):
        if i % 5 == 4:
            out.append(("truncate", rng.randrange(len(data)), 0))
            continue
        pos = rng.choice(structure) if i % 2 else rng.randrange(len(data))
        out.append(("flip", pos, rng.randrange(1, 256)))
    return out


def mutate(data: bytes, kind: str, pos: int, value: int) -> bytes:
    if kind == "truncate":
        return data[:pos]
    changed = bytearray(data)
    changed[pos] ^= value
    return bytes(changed)


class Fuzz:
    def __init__(self, base: Path, work: Path, ckpt: Path, read: Callable[[Path], Tensors]):
        self.base, self.work, self.ckpt, self.read = base, work, ckpt, read
        self.original = read(ckpt)
        self.reference: Tensors | None = None
        self.outcomes: dict[str, int] = {}
        self.problems: list[str] = []

    def merge(self) -> Tensors:
        from safetensors.torch import load_file

        out = self.work / "out"
        shutil.rmtree(out, ignore_errors=True)
        cfg = {"base_model": str(self.base), "output_dir": str(self.work)}
        merge_fsdp_weights(cfg, out, checkpoint=self.ckpt, verify=True, quiet=True)
        got = load_file(out / "model.safetensors")
        shutil.rmtree(out)
        return got

    def run(self, target: Path, n: int, rng: random.Random) -> None:
        data = target.read_bytes()
        payload = [] if target.name == ".metadata" else payload_ranges(self.ckpt, target)
        self.reference = self.merge()
        cases = mutations(data, payload, n, rng)
        try:
            for i, case in enumerate(cases):
                target.write_bytes(mutate(data, *case))
                self.one(f"{target.name} {case}", full=i < FULL_MERGES)
        finally:
            target.write_bytes(data)
        assert same(self.read(self.ckpt), self.original)  # restored

    def one(self, label: str, full: bool) -> None:
        try:
            got = self.read(self.ckpt)
        except ShardforgeError:
            outcome = "refused"
        except Exception as exc:
            self.problems.append(f"{label}: {type(exc).__name__}: {exc}")
            return
        else:
            if same(got, self.original):
                outcome = "identical"
            elif same_names(got, self.original):
                self.problems.append(f"{label}: read different values without an error")
                return
            else:
                outcome = "renamed"
                full = True
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if full:
            self.whole_merge(label, outcome)

    def whole_merge(self, label: str, outcome: str) -> None:
        try:
            merged = self.merge()
        except ShardforgeError:
            return
        except Exception as exc:
            self.problems.append(f"{label}: the merge raised {type(exc).__name__}: {exc}")
            return
        assert self.reference is not None
        if outcome == "renamed" or not same(merged, self.reference):
            self.problems.append(f"{label}: the merge wrote another output ({outcome})")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def meshes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mesh_rank_files(tmp_path_factory)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", list(CASES))
def test_mutations_are_refused_or_harmless(
    built: Built,
    tmp_path: Path,
    target: str,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    rng = random.Random(f"{SEED}-{target}")
    if target == "rank2d":  # rank 1 of 2x2: strided shards, (Shard, Shard), sub-mesh copies
        root = request.getfixturevalue("meshes")
        ckpt = Path(shutil.copytree(root / "tp", tmp_path / "run" / "model"))
        fuzz = Fuzz(root / "base", tmp_path / "run", ckpt, read_ranks)
        path = ckpt / "model_world_size_4_rank_1.pt"
    elif target == "rank":
        src = built.root / "lmms" / f"checkpoint-{LMMS_STEP}" / "pytorch_model_fsdp_0"
        ckpt = Path(shutil.copytree(src, tmp_path / "run" / "model"))
        fuzz = Fuzz(built.base, tmp_path / "run", ckpt, read_ranks)
        path = ckpt / f"model_world_size_{WORLD}_rank_0.pt"
    else:
        src = built.ours / "checkpoint-4" / "model"
        ckpt = Path(shutil.copytree(src, tmp_path / "run" / "model"))
        fuzz = Fuzz(built.base, tmp_path / "run", ckpt, read_dcp)
        path = ckpt / (".metadata" if target == "metadata" else "__0_0.distcp")
    start = time.perf_counter()
    fuzz.run(path, CASES[target], rng)
    with capsys.disabled():
        print(f"\n{target}: {fuzz.outcomes} in {time.perf_counter() - start:.1f}s")
    assert not fuzz.problems, "\n".join(fuzz.problems[:20])
    assert fuzz.outcomes.get("refused", 0) >= CASES[target] // 4  # the mutations did bite
