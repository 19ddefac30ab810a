"""The contract every registered checkpoint format keeps (`formats.base.CheckpointFormat`).

Each row of `formats.registry.FORMATS` is run on a real checkpoint of its format, written by
that format's own writer (torch DCP, real gloo ranks saving FSDP2 DTensors, the `safetensors`
library): it recognises its folder and no other, opens every tensor from metadata, describes
the same tensors for `inspect`, lists shard files that exist inside the folder, and its
independent reference reader returns every tensor bit for bit as the merge's own source reads
it. A format added to the registry without a fixture here fails `test_every_format_has_a_fixture`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path, PurePath

import pytest
import torch

from helpers.dist import run_on_ranks
from shardforge.formats.base import CheckpointFormat, Contents, NamedSource, ReferenceReader
from shardforge.formats.registry import FORMATS, detect, format_named
from shardforge.io.copy import ReadCache

pytestmark = pytest.mark.slow  # the rank-files fixture starts two gloo ranks

TENSORS: dict[str, torch.Tensor] = {
    "model.embed.weight": torch.arange(42, dtype=torch.float32).reshape(7, 6) / 7,
    "model.norm.weight": torch.linspace(-1, 1, 6, dtype=torch.float32),
    "model.layers.0.proj.weight": torch.randn(5, 6, generator=torch.Generator().manual_seed(0)),
}


def _write_dcp(root: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = root / "dcp"
    dcp.save(dict(TENSORS), checkpoint_id=folder, no_dist=True)
    return folder


def _save_rank(rank: int, world_size: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in TENSORS.items()}
    torch.save(state, f"{out_dir}/model_world_size_{world_size}_rank_{rank}.pt")


def _write_rank_files(root: Path) -> Path:
    folder = root / "ranks"
    folder.mkdir()
    run_on_ranks(_save_rank, 2, str(folder))
    return folder


def _write_safetensors(root: Path) -> Path:
    from safetensors.torch import save_file

    folder = root / "hf"
    folder.mkdir()
    save_file(dict(TENSORS), str(folder / "model.safetensors"))
    return folder


# format name -> how a test writes a real checkpoint of it (with that format's own writer)
FIXTURES: dict[str, Callable[[Path], Path]] = {
    "dcp": _write_dcp,
    "rank-files": _write_rank_files,
    "safetensors": _write_safetensors,
}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    return {name: write(root) for name, write in FIXTURES.items()}


def test_every_format_has_a_fixture() -> None:
    assert sorted(f.name for f in FORMATS) == sorted(FIXTURES)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_row_implements_every_method(fmt: CheckpointFormat) -> None:
    """Each method is the format's own (none left to the protocol), each class fact is set."""
    for method in ("detect", "open", "describe", "shard_files", "reference"):
        assert getattr(type(fmt), method) is not getattr(CheckpointFormat, method), method
    assert fmt.name and fmt.looked_for and fmt.shards_described
    assert format_named(fmt.name) is fmt


def test_a_format_without_a_method_cannot_be_registered() -> None:
    class NoDescribe(CheckpointFormat):
        name = "half"
        looked_for = shards_described = "-"

        def detect(self, folder: Path) -> bool:
            return False

        def open(self, folder: Path) -> dict[str, NamedSource]:
            return {}

        def shard_files(self, folder: Path) -> list[PurePath]:
            return []

        def reference(self, location: Path) -> ReferenceReader:
            raise NotImplementedError

    with pytest.raises(TypeError, match="describe"):
        NoDescribe()  # type: ignore[abstract]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_detects_its_own_folder_only(fmt: CheckpointFormat, written: dict[str, Path]) -> None:
    for name, folder in written.items():
        assert fmt.detect(folder) == (name == fmt.name), (fmt.name, name)
    if fmt.sharded:
        assert detect(written[fmt.name]) is fmt


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_open_and_describe_agree_with_what_was_written(
    fmt: CheckpointFormat, written: dict[str, Path]
) -> None:
    folder = written[fmt.name]
    named = fmt.open(folder)
    assert sorted(named) == sorted(TENSORS)
    for key, n in named.items():
        assert (n.shape, n.dtype) == (tuple(TENSORS[key].shape), TENSORS[key].dtype), key
    contents = fmt.describe(folder)
    assert isinstance(contents, Contents) and contents.storage == fmt.name
    facts = {t.name: t for t in contents.tensors}
    assert sorted(facts) == sorted(TENSORS)
    for key, t in TENSORS.items():
        assert facts[key].shape == tuple(t.shape) and facts[key].numel == t.numel()
        assert facts[key].nbytes == math.prod(t.shape) * t.element_size()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_shard_files_exist_inside_the_folder(
    fmt: CheckpointFormat, written: dict[str, Path]
) -> None:
    folder = written[fmt.name]
    files = fmt.shard_files(folder)
    assert files
    for rel in files:
        assert not rel.is_absolute() and ".." not in rel.parts
        assert (folder / rel).is_file(), rel


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_reference_reader_gives_what_the_source_reads(
    fmt: CheckpointFormat, written: dict[str, Path]
) -> None:
    named = fmt.open(written[fmt.name])
    with ReadCache() as reader:
        for key, n in named.items():
            (stored,) = n.source.stored()
            assert stored.fmt == fmt.name
            ref = fmt.reference(stored.directory)
            ref.check_crcs({stored.key})
            got = ref.load([stored])[stored.key]
            ours = n.source.read(reader)
            assert torch.equal(got.view(torch.uint8), ours.view(torch.uint8)), key
            assert torch.equal(ours, TENSORS[key]), key
