"""Crafted storage: records and `.metadata` entries that point where they should not, special
files and links leaving the checkpoint. Each is refused with one line naming the file, no hang
and nothing written, by the merge CLI, by `shardforge inspect` where it reads the same thing,
and on the rank-file path.

The checkpoints are the real ones of `test_inspection` (3 gloo ranks of a `fully_shard`-ed tiny
Llama: our DCP layout and LMMs-Engine rank files), copied per test; crafted records are real
zip archives whose `data.pkl` is written the way `torch.save` writes it, with chosen values.
"""

from __future__ import annotations

import collections
import hashlib
import io
import os
import pickle
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner, Result

from shardforge.cli.main import cli
from shardforge.errors import CheckpointError
from shardforge.formats.dcp.chunks import locate, read
from shardforge.formats.dcp.metadata import Chunk, read_metadata
from shardforge.io.copy import ReadCache
from test_inspection import LMMS_STEP, WORLD, Built, build_checkpoints

# every test copies the checkpoints that gloo ranks write (build_checkpoints)
pytestmark = pytest.mark.slow

# -- torch.save records with chosen values ------------------------------------------------------


class _Storage:
    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _View:
    """Pickles as torch.save pickles a tensor: `_rebuild_tensor_v2(storage, offset, size, ...)`."""

    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self) -> tuple[Any, tuple]:
        return torch._utils._rebuild_tensor_v2, self.args


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def crafted_zip(root: str, obj: Any, storages: dict[str, bytes]) -> bytes:
    pkl = io.BytesIO()
    _TorchPickler(pkl, protocol=2).dump(obj)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{root}/data.pkl", pkl.getvalue())
        zf.writestr(f"{root}/byteorder", b"little")
        for key, data in storages.items():
            zf.writestr(f"{root}/data/{key}", data)
    return out.getvalue()


def view_record(t: torch.Tensor, offset: int, size: tuple, stride: tuple, numel: int = 0) -> bytes:
    """A record of float32 tensor `t`'s bytes as storage, described with the given view."""
    data = t.contiguous().numpy().tobytes()
    storage = _Storage("0", numel or t.numel())
    return crafted_zip("archive", _View(storage, offset, size, stride), {"0": data})


# -- checkpoints --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


@pytest.fixture
def dcp_dir(built: Built, tmp_path: Path) -> Path:
    """The model directory of a private copy of a real checkpoint of ours (3 ranks: model and
    optimizer DCP directories, trainer state, RNG files), so resume can be pointed at it too."""
    copy = shutil.copytree(built.ours / "checkpoint-4", tmp_path / "run" / "checkpoint-4")
    return Path(copy) / "model"


@pytest.fixture
def rank_dir(built: Built, tmp_path: Path) -> Path:
    src = built.root / "lmms" / f"checkpoint-{LMMS_STEP}" / "pytorch_model_fsdp_0"
    return Path(shutil.copytree(src, tmp_path / "ranks" / "model"))


def load_meta(ckpt: Path) -> Any:
    with (ckpt / ".metadata").open("rb") as f:
        return pickle.load(f)  # our own test file


def save_meta(ckpt: Path, meta: Any) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))


def storage_items(meta: Any, key: str) -> list[tuple[Any, Any]]:
    """(MetadataIndex, _StorageInfo) of `key`'s chunks, in chunk-offset order."""
    return sorted(
        ((i, s) for i, s in meta.storage_data.items() if i.fqn == key), key=lambda p: p[0].offset
    )


def replace_record(ckpt: Path, key: str, chunk: int, make: Callable[[bytes], bytes]) -> None:
    """Replace one stored record by `make(old record)`; the data file is rebuilt and every
    offset in `.metadata` moved accordingly."""
    meta = load_meta(ckpt)
    _, target = storage_items(meta, key)[chunk]
    path = ckpt / target.relative_path
    data = path.read_bytes()
    infos = sorted(
        (s for s in meta.storage_data.values() if s.relative_path == target.relative_path),
        key=lambda s: s.offset,
    )
    out = bytearray()
    for info in infos:
        record = data[info.offset : info.offset + info.length]
        if info is target:
            record = make(record)
        info.offset, info.length = len(out), len(record)
        out += record
    path.write_bytes(bytes(out))
    save_meta(ckpt, meta)


# -- the CLI -----------------------------------------------------------------------------------


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def merge(built: Built, checkpoint: Path, *extra: str) -> Result:
    work = checkpoint.parent.parent
    cfg = work / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(built.base), "output_dir": str(work)}))
    args = ["--quiet", "--checkpoint", str(checkpoint), "--output_path", str(work / "out")]
    return CliRunner().invoke(cli, ["merge-sharded-fsdp-weights", str(cfg), *args, *extra])


def error_line(result: Result) -> str:
    """The one `error:` line, last; no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code != 0, result.output
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert sum(line.startswith("error") for line in lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return lines[-1]


def assert_refused(built: Built, checkpoint: Path, *words: str, inspect: bool = False) -> None:
    """The merge (and `inspect` when it reads the same thing) refuses with one line naming
    `words`; nothing is written and the input is unchanged."""
    work = checkpoint.parent.parent
    before = tree_hash(checkpoint)
    line = error_line(merge(built, checkpoint))
    for w in words:
        assert w in line, (w, line)
    assert not (work / "out").exists() and not list(work.glob(".out*"))
    assert tree_hash(checkpoint) == before
    if inspect:
        line = error_line(CliRunner().invoke(cli, ["inspect", str(checkpoint)]))
        for w in words:
            assert w in line, (w, line)
    if (checkpoint.parent / "trainer_state.json").exists():
        line = resume_error(built, checkpoint.parent)
        for w in words:
            assert w in line, (w, line)
        assert tree_hash(checkpoint) == before


def resume_error(built: Built, checkpoint: Path) -> str:
    """What resuming from `checkpoint` says: the named checkpoint is refused by the checks
    resume runs first, or (for damage only reading the records shows) by its checked reader."""
    from shardforge.formats.dcp.reader import load_checked
    from shardforge.train.checkpointing import resolve_resume

    try:
        resolve_resume(str(checkpoint), checkpoint.parent, announce=False)
    except CheckpointError as exc:
        assert "\n" not in exc.message
        return exc.message
    reference = read_metadata(built.ours / "checkpoint-4" / "model").tensors.values()
    state = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in reference}
    with pytest.raises(CheckpointError) as info:
        load_checked(state, checkpoint / "model", no_dist=True)
    return info.value.message


# -- records ------------------------------------------------------------------------------------

NORM = "model.norm.weight"  # (64,) over 3 ranks: chunks of 22, 22, 20


def norm_chunk(ckpt: Path) -> Chunk:
    return read_metadata(ckpt).tensors[NORM].chunks[0]


@pytest.mark.parametrize(
    ("offset", "size", "stride", "numel", "words"),
    [
        (22, (22,), (1,), 0, "reaches element 43 of a storage of 22"),  # into the next record
        (0, (22,), (1000,), 0, "reaches element 21000"),  # a stride past the storage
        (-3, (22,), (1,), 0, "negative"),
        (0, (22,), (-1,), 0, "negative"),
        (0, (22,), (1,), 1 << 40, "claims a storage of 1099511627776 elements"),
        (2**62, (22,), (2**62,), 0, "reaches element"),
    ],
)
def test_views_outside_their_storage(
    built: Built,
    dcp_dir: Path,
    offset: int,
    size: tuple,
    stride: tuple,
    numel: int,
    words: str,
) -> None:
    ref = torch.arange(22, dtype=torch.float32)
    replace_record(dcp_dir, NORM, 0, lambda _: view_record(ref, offset, size, stride, numel))
    chunk = norm_chunk(dcp_dir)
    where = f"at byte {chunk.byte_offset}"
    assert_refused(built, dcp_dir, chunk.file.name, where, words)


def test_an_honest_crafted_record_merges(built: Built, dcp_dir: Path) -> None:
    """The crafting itself is sound: the same record with a true view merges to its values."""
    from safetensors.torch import load_file

    ref = torch.arange(30, dtype=torch.float32)
    replace_record(dcp_dir, NORM, 0, lambda _: view_record(ref, 8, (22,), (1,)))
    result = merge(built, dcp_dir)
    assert result.exit_code == 0, result.output
    out = load_file(dcp_dir.parent.parent / "out" / "model.safetensors")
    assert torch.equal(out[NORM][:22], ref[8:30])


def test_central_directory_pointing_at_the_neighbour_record(built: Built, dcp_dir: Path) -> None:
    """Record A's directory sends its storage member to the next record's storage header: the
    old parser merged the neighbour's bytes with exit 0."""
    chunk = norm_chunk(dcp_dir)
    data = bytearray(chunk.file.read_bytes())
    start, end = chunk.byte_offset, chunk.byte_offset + chunk.byte_length
    chunks = [c for e in read_metadata(dcp_dir).tensors.values() for c in e.chunks]
    (after,) = [c for c in chunks if c.file == chunk.file and c.byte_offset == end]
    # the next record's storage header, relative to this record's start
    next_cd = struct.unpack_from("<I", data, end + after.byte_length - 22 + 16)[0]
    target = struct.unpack_from("<I", data, end + storage_entry(data, end, next_cd) + 42)[0]
    cd = struct.unpack_from("<I", data, end - 22 + 16)[0]
    struct.pack_into("<I", data, start + storage_entry(data, start, cd) + 42, end - start + target)
    chunk.file.write_bytes(bytes(data))
    assert_refused(built, dcp_dir, chunk.file.name, f"at byte {start}", "outside the archive")


def storage_entry(data: bytearray, start: int, cd: int) -> int:
    """Offset (from `start`) of the central-directory entry of `archive/data/0`."""
    pos = cd
    while True:
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, start + pos + 28)
        if data[start + pos + 46 : start + pos + 46 + name_len] == b"archive/data/0":
            return pos
        pos += 46 + name_len + extra_len + comment_len


def test_one_byte_range_under_two_entries_of_different_shapes(dcp_dir: Path) -> None:
    """The parsed-record cache checks every entry against its own shape (the old cache
    skipped the check for the second entry: half the tensor zeros). `.metadata` refuses such
    entries first (below); here the reader is given them directly."""
    chunk = norm_chunk(dcp_dir)
    other = Chunk((0,), (44,), chunk.file, chunk.byte_offset, chunk.byte_length)
    with ReadCache() as reader:
        read(reader, chunk)
        with pytest.raises(CheckpointError, match=r"holds shape \[22\], .metadata says \[44\]"):
            read(reader, other)


def test_two_entries_on_one_byte_range(built: Built, dcp_dir: Path) -> None:
    meta = load_meta(dcp_dir)
    (_, a), (_, b) = storage_items(meta, NORM)[:2]
    b.relative_path, b.offset, b.length = a.relative_path, a.offset, a.length
    save_meta(dcp_dir, meta)
    assert_refused(built, dcp_dir, ".metadata", NORM, "the same bytes", inspect=True)


def test_overlapping_byte_ranges(built: Built, dcp_dir: Path) -> None:
    meta = load_meta(dcp_dir)
    (_, a), (_, b) = storage_items(meta, NORM)[:2]
    b.relative_path, b.offset = a.relative_path, a.offset + 10
    save_meta(dcp_dir, meta)
    assert_refused(built, dcp_dir, ".metadata", "overlapping bytes", inspect=True)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("offset", -5, "corrupt metadata"),
        ("length", -5, "corrupt metadata"),
        ("length", 1 << 70, "truncated"),
        ("offset", 1 << 70, "truncated"),
    ],
)
def test_byte_ranges_outside_the_file(
    built: Built, dcp_dir: Path, field: str, value: int, words: str
) -> None:
    meta = load_meta(dcp_dir)
    setattr(storage_items(meta, NORM)[0][1], field, value)
    save_meta(dcp_dir, meta)
    assert_refused(built, dcp_dir, words, inspect=True)


def _edit_chunks(ckpt: Path, key: str, edit: Callable[[list[Any]], None]) -> None:
    meta = load_meta(ckpt)
    edit(meta.state_dict_metadata[key].chunks)
    save_meta(ckpt, meta)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("overlap", "overlap"),
        ("gap", "cover 42 of 64 elements"),
        ("outside", "lies outside its shape"),
        ("negative", "lies outside its shape"),
        ("huge", "lies outside its shape"),
    ],
)
def test_chunks_that_do_not_tile(built: Built, dcp_dir: Path, case: str, words: str) -> None:
    meta = load_meta(dcp_dir)
    items = storage_items(meta, NORM)
    chunks = sorted(meta.state_dict_metadata[NORM].chunks, key=lambda c: tuple(c.offsets))
    if case == "overlap":  # the second chunk moved onto the first (its storage index too)
        moved = (chunks[0].offsets[0] + 1,)
        meta.storage_data[type(items[1][0])(NORM, torch.Size(moved), items[1][0].index)] = items[1][
            1
        ]
        del meta.storage_data[items[1][0]]
        chunks[1].offsets = torch.Size(moved)
    elif case == "gap":
        meta.state_dict_metadata[NORM].chunks.remove(chunks[1])
    elif case == "outside":
        chunks[2].sizes = torch.Size([30])
    elif case == "negative":
        chunks[2].sizes = torch.Size([-20])
    else:
        chunks[2].sizes = torch.Size([1 << 62])
    save_meta(dcp_dir, meta)
    assert_refused(built, dcp_dir, ".metadata", NORM, words, inspect=True)


# -- files --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_a_data_file(built: Built, dcp_dir: Path) -> None:
    (dcp_dir / "__1_0.distcp").unlink()
    os.mkfifo(dcp_dir / "__1_0.distcp")
    assert_refused(built, dcp_dir, "__1_0.distcp", "FIFO", inspect=True)


@pytest.mark.parametrize("target", ["/dev/zero", "outside"])
def test_data_file_linked_out_of_the_checkpoint(
    built: Built, dcp_dir: Path, tmp_path: Path, target: str
) -> None:
    shard = dcp_dir / "__1_0.distcp"
    if target == "outside":
        target = str(shutil.move(shard, tmp_path / "elsewhere.distcp"))
    else:
        shard.unlink()
    shard.symlink_to(target)
    assert_refused(built, dcp_dir, "__1_0.distcp", "leaves the checkpoint", inspect=True)


def test_metadata_linked_out_of_the_checkpoint(built: Built, dcp_dir: Path, tmp_path: Path) -> None:
    moved = shutil.move(dcp_dir / ".metadata", tmp_path / "elsewhere.metadata")
    (dcp_dir / ".metadata").symlink_to(moved)
    assert_refused(built, dcp_dir, ".metadata", "outside the checkpoint", inspect=True)


def test_a_checkpoint_directory_that_is_a_link_merges(
    built: Built, dcp_dir: Path, tmp_path: Path
) -> None:
    link = tmp_path / "run" / "latest"
    link.symlink_to(dcp_dir)
    result = merge(built, link)
    assert result.exit_code == 0, result.output


def test_a_file_cut_short_after_its_metadata_was_read(dcp_dir: Path) -> None:
    """A data file that shrinks during the merge: a short read is an error, never zeros."""
    meta = read_metadata(dcp_dir)
    chunk = meta.tensors["model.embed_tokens.weight"].chunks[0]
    with ReadCache() as reader:
        _, raw = locate(reader, chunk)
        assert raw is not None
        os.truncate(chunk.file, raw.data_offset + 8)
        with pytest.raises(CheckpointError, match=r"__0_0\.distcp: short read at byte \d+"):
            read(reader, chunk)


# -- rank files ---------------------------------------------------------------------------------


def rank_file(rank_dir: Path, rank: int = 1) -> Path:
    return rank_dir / f"model_world_size_{WORLD}_rank_{rank}.pt"


def test_rank_file_linked_out_of_the_checkpoint(
    built: Built, rank_dir: Path, tmp_path: Path
) -> None:
    moved = shutil.move(rank_file(rank_dir), tmp_path / "elsewhere.pt")
    rank_file(rank_dir).symlink_to(moved)
    assert_refused(
        built, rank_dir, rank_file(rank_dir).name, "outside the checkpoint", inspect=True
    )


def _plain_rank_dir(built: Built, rank_dir: Path, bad: tuple[int, tuple, tuple, int]) -> Path:
    """A world-size-1 rank file of the base model's plain tensors (as `torch.save(sd)` writes
    them), with `model.norm.weight` described by the view `bad`."""
    from transformers import AutoModelForCausalLM

    for p in rank_dir.iterdir():
        p.unlink()
    sd = AutoModelForCausalLM.from_pretrained(built.base).state_dict()
    obj: collections.OrderedDict[str, _View] = collections.OrderedDict()
    storages = {}
    for i, (name, t) in enumerate(sd.items()):
        t = t.float().contiguous()
        storages[str(i)] = t.numpy().tobytes()
        offset, size, stride, numel = (0, tuple(t.shape), t.stride(), t.numel())
        if name == NORM:
            offset, size, stride, numel = bad
        obj[name] = _View(_Storage(str(i), numel), offset, size, stride)
    path = rank_dir / "model_world_size_1_rank_0.pt"
    path.write_bytes(crafted_zip("model_world_size_1_rank_0", obj, storages))
    return path


def test_rank_file_crafting_is_sound(built: Built, rank_dir: Path) -> None:
    _plain_rank_dir(built, rank_dir, (0, (64,), (1,), 64))
    result = merge(built, rank_dir)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ((1, (64,), (1,), 64), "reaches element 64 of a storage of 64"),
        ((0, (64,), (5,), 64), "reaches element 315"),
        ((0, (64,), (1,), 65), "claims a storage of 65 elements"),
        ((0, (64,), (-1,), 64), "negative"),
    ],
)
def test_rank_file_views_outside_their_storage(
    built: Built, rank_dir: Path, bad: tuple[int, tuple, tuple, int], words: str
) -> None:
    path = _plain_rank_dir(built, rank_dir, bad)
    assert_refused(built, rank_dir, path.name, NORM, words, inspect=True)


@pytest.mark.timeout(60)
def test_rank_file_fifo(built: Built, rank_dir: Path) -> None:
    rank_file(rank_dir).unlink()
    os.mkfifo(rank_file(rank_dir))
    assert_refused(built, rank_dir, rank_file(rank_dir).name, inspect=True)
