"""Seeded fuzzing of every reader: byte flips and truncations of a real file of each format,
each read in-process through every tensor's source, with every stored record's CRC-32 checked
where the format has one (and every copy of a replicated piece compared). Every outcome is a
clean `ShardforgeError` or tensors bit-identical to the original's; nothing else is raised and
nothing hangs.

The files: a DCP `.metadata` and `.distcp` and a verl rank file (`test_inspection`'s
checkpoints), a rank file of a 2-D FSDP2 + TP mesh (strided shards, sub-mesh copies) from
`helpers.meshes`, and, from `helpers.shared.saved_formats`, an accelerate `pytorch_model_fsdp_0_rank
0.bin`, a collective-free DCP's `__1.metadata`, a DCP safetensors shard file and torch's
consolidated file. Safetensors has no checksum: a flip inside a tensor's bytes cannot be seen by
any reader, so those two take their flips in the header (what the reader parses and
cross-checks against the other files), and their truncations anywhere.

A flip may also rename a key (the read then succeeds with other names); such cases, and a
sample of the others, go through the whole merge (`merge_fsdp_weights(..., verify=True)`, whose
verification checks the CRC-32s too), which must refuse or write an output identical to the
original merge.
"""

from __future__ import annotations

import random
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers.meshes import mesh_rank_files
from shardforge.errors import ShardforgeError
from shardforge.formats.accelerate_bin.format import ACCELERATE_NAMES
from shardforge.formats.dcp.chunks import locate, read_full
from shardforge.formats.dcp.metadata import CheckpointMetadata, read_metadata
from shardforge.formats.dcp_ranks.rank_metadata import read_rank_metadata
from shardforge.formats.rankfiles.names import RANK_NAMES, RankNames
from shardforge.formats.rankfiles.rank_file import read_rank_file
from shardforge.formats.rankfiles.rank_plan import plan_from_files, read_rank_files
from shardforge.formats.rankfiles.source import RankFileSource
from shardforge.formats.registry import detect
from shardforge.io.copy import ReadCache
from shardforge.io.zip_record import check_crc
from shardforge.merge.api import merge_fsdp_weights
from test_inspection import LMMS_STEP, WORLD, Built, build_checkpoints

# the checkpoints are written by gloo ranks (build_checkpoints)
pytestmark = pytest.mark.slow

SEED = 20240610
CASES = {"metadata": 100, "distcp": 80, "rank": 90, "rank2d": 60}  # mutations per target
# the readers of `helpers.shared.saved_formats`: target -> mutations
NEW_CASES = {"accelerate-bin": 40, "rank-metadata": 60, "shard": 60, "consolidated": 40}
FULL_MERGES = 3  # per target: cases also run through the whole merge

Tensors = dict[str, torch.Tensor]


def read_dcp(ckpt: Path) -> Tensors:
    """Every tensor of a DCP directory through the merge's reader; every record's CRC-32."""
    return read_entries(read_metadata(ckpt))


def read_dcp_ranks(ckpt: Path) -> Tensors:
    """The same for a collective-free DCP (every rank's metadata)."""
    return read_entries(read_rank_metadata(ckpt))


def read_entries(meta: CheckpointMetadata) -> Tensors:
    out = {}
    with ReadCache() as reader:
        for key, entry in meta.tensors.items():
            for chunk in entry.chunks:
                fd, raw = locate(reader, chunk)
                if raw is not None:
                    check_crc(fd, raw.storage, str(chunk.file))
            out[key] = read_full(reader, entry)
    return out


def read_ranks(folder: Path, names: RankNames = RANK_NAMES) -> Tensors:
    """Every full tensor of a rank-file folder through its sources; every record's CRC-32."""
    files = read_rank_files(folder, names)
    plans = plan_from_files(files)
    with ReadCache() as reader:
        for rf in files:
            for rec in rf.tensors.values():
                check_crc(reader.fd(rec.path), rec.storage, str(rec.path))
        return {key: RankFileSource(plan).read(reader) for key, plan in plans.items()}


def read_accelerate(folder: Path) -> Tensors:
    return read_ranks(folder, ACCELERATE_NAMES)


def read_format(folder: Path) -> Tensors:
    """Every tensor of a folder through its format's row and sources (safetensors: no CRC)."""
    fmt = detect(folder)
    assert fmt is not None
    with ReadCache() as reader:
        return {k: n.source.read(reader) for k, n in fmt.open(folder).items()}


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
    """Byte ranges of `path` holding tensor bytes (changes there only a CRC can see)."""
    if path.name.endswith(".metadata"):
        return []
    if path.suffix == ".safetensors":
        (n,) = struct.unpack("<Q", path.read_bytes()[:8])
        return [(8 + n, path.stat().st_size)]
    with ReadCache() as reader:
        if path.suffix == ".distcp":
            chunks = [c for e in read_metadata(ckpt).tensors.values() for c in e.chunks]
            raws = [locate(reader, c)[1] for c in chunks if c.file == path]
            return [(r.storage.data_offset, r.storage.data_end) for r in raws if r is not None]
    recs = read_rank_file(path, (2, 0)).tensors.values()  # the file's name is not read
    return [(r.storage.data_offset, r.storage.data_end) for r in recs]


def mutations(
    data: bytes, payload: list[tuple[int, int]], n: int, rng: random.Random, checksummed: bool
) -> list:
    """(kind, position, value): truncations, and flips: half of them outside tensor payload
    (all of them where the format has no checksum)."""
    in_payload = bytearray(len(data))
    for start, end in payload:
        in_payload[start:end] = b"\1" * (end - start)
    structure = [i for i in range(len(data)) if not in_payload[i]]
    out: list[tuple[str, int, int]] = []
    for i in range(n):
        if i % 5 == 4:
            out.append(("truncate", rng.randrange(len(data)), 0))
            continue
        pos = rng.choice(structure) if i % 2 or not checksummed else rng.randrange(len(data))
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
        payload = payload_ranges(self.ckpt, target)
        self.reference = self.merge()
        cases = mutations(data, payload, n, rng, checksummed=target.suffix != ".safetensors")
        try:
            for i, case in enumerate(cases):
                target.write_bytes(mutate(data, *case))
                self.one(f"{target.name} {case}", full=i < FULL_MERGES)
        finally:
            target.write_bytes(data)
        assert same(self.read(self.ckpt), self.original)  # restored

    def check(
        self, target: Path, n: int, rng: random.Random, label: str, capsys: pytest.CaptureFixture
    ) -> None:
        """`run`, then: no problem, and at least a quarter of the mutations refused."""
        start = time.perf_counter()
        self.run(target, n, rng)
        with capsys.disabled():
            print(f"\n{label}: {self.outcomes} in {time.perf_counter() - start:.1f}s")
        assert not self.problems, "\n".join(self.problems[:20])
        assert self.outcomes.get("refused", 0) >= n // 4  # the mutations did bite

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
    fuzz.check(path, CASES[target], rng, target, capsys)


# target -> (the folder in `saved_formats`, the file mutated in it, the reader)
NEW_TARGETS: dict[str, tuple[str, str, Callable[[Path], Tensors]]] = {
    "accelerate-bin": (
        "accelerate/checkpoint_1",
        "pytorch_model_fsdp_0_rank0.bin",
        read_accelerate,
    ),
    "rank-metadata": ("collective-free/checkpoint-2", "__1.metadata", read_dcp_ranks),
    "shard": ("hf-sharded", "shard-00002-model-00001-of-00001.safetensors", read_format),
    "consolidated": ("titan/step-4", "model-00001-of-00001.safetensors", read_format),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", list(NEW_CASES))
def test_the_new_readers_refuse_mutations_or_read_the_same(
    saved: Path, tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(f"{SEED}-{target}")
    folder, name, read = NEW_TARGETS[target]
    ckpt = Path(shutil.copytree(saved / folder, tmp_path / "run" / "model"))
    fuzz = Fuzz(saved / "base", tmp_path / "run", ckpt, read)
    fuzz.check(ckpt / name, NEW_CASES[target], rng, target, capsys)
