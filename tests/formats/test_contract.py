"""The contract every registered checkpoint format keeps (`formats.base.CheckpointFormat`).

Each row of `formats.registry.FORMATS` is run on real checkpoints of its format (each of its
forms), written by that format's own writer (torch DCP; 2 gloo ranks saving FSDP2 DTensors with
torch.save, accelerate's save_fsdp_model, dcp.save without collectives and DCP's safetensors
storage, `helpers.shared.saved_formats`; the `safetensors` library): it recognises its folders
and no other, opens every tensor from metadata, describes the same tensors for `inspect`, lists
shard files that exist inside the folder, and its independent reference reader returns every
tensor bit for bit as the merge's own source reads it (floats, int64, bool and uint8; a rank
with an empty shard). A format added to the registry without a fixture here fails
`test_every_format_has_a_fixture`.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path, PurePath

import pytest
import torch

from helpers.shared import contract_tensors, saved_formats
from shardforge.formats.base import CheckpointFormat, Contents, NamedSource, ReferenceReader
from shardforge.formats.registry import FORMATS, detect, format_named
from shardforge.io.copy import ReadCache

pytestmark = pytest.mark.slow  # the shared fixtures are written by two gloo ranks

Tensors = dict[str, torch.Tensor]
TENSORS: Tensors = contract_tensors()


def _write_dcp(factory: pytest.TempPathFactory) -> tuple[Path, Tensors]:
    import torch.distributed.checkpoint as dcp

    folder = factory.mktemp("dcp")
    dcp.save(dict(TENSORS), checkpoint_id=folder, no_dist=True)
    return folder, TENSORS


def _write_safetensors(factory: pytest.TempPathFactory) -> tuple[Path, Tensors]:
    from safetensors.torch import save_file

    folder = factory.mktemp("hf")
    save_file(dict(TENSORS), str(folder / "model.safetensors"))
    return folder, TENSORS


def _saved(sub: str, floats_only: bool = False) -> Callable[..., tuple[Path, Tensors]]:
    """A folder of the shared checkpoints (`helpers.shared.saved_formats`)."""

    def get(factory: pytest.TempPathFactory) -> tuple[Path, Tensors]:
        return saved_formats(factory) / sub, contract_tensors(floats_only)

    return get


def _accelerate(factory: pytest.TempPathFactory) -> tuple[Path, Tensors]:
    """accelerate's save_fsdp_model(use_dcp=False) of a tiny Llama (the contract's tensors
    cannot be a model's: the real API saves a model)."""
    from safetensors.torch import load_file

    root = saved_formats(factory)
    return root / "accelerate" / "checkpoint_1", load_file(root / "trained" / "model.safetensors")


# fixture name (a format's name, or "<format>:<variant>" for another form of it) -> a real
# checkpoint of it written by that format's own writer, and the tensors it holds
FIXTURES: dict[str, Callable[[pytest.TempPathFactory], tuple[Path, Tensors]]] = {
    "dcp": _write_dcp,
    "dcp-ranks": _saved("contract/dcp-ranks"),
    "rank-files": _saved("contract/rank-files"),
    "accelerate-bin": _accelerate,
    "dcp-safetensors": _saved("contract/dcp-safetensors"),
    "dcp-safetensors:consolidated": _saved("contract/consolidated", floats_only=True),
    "safetensors": _write_safetensors,
}


def _format_of(fixture: str) -> str:
    return fixture.split(":")[0]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Tensors]]:
    return {name: write(tmp_path_factory) for name, write in FIXTURES.items()}


def _own(fmt: CheckpointFormat) -> list[str]:
    return [name for name in FIXTURES if _format_of(name) == fmt.name]


def test_every_format_has_a_fixture() -> None:
    assert sorted(f.name for f in FORMATS) == sorted({_format_of(n) for n in FIXTURES})


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_row_implements_every_method(fmt: CheckpointFormat) -> None:
    """Each method is the format's own (none left to the protocol), each class fact is set."""
    for method in ("detect", "open", "describe", "shard_files", "reference"):
        assert getattr(type(fmt), method) is not getattr(CheckpointFormat, method), method
    assert fmt.name and fmt.looked_for and fmt.shards_described
    assert format_named(fmt.name) is fmt


def test_the_registry_is_read_before_torch_is_imported() -> None:
    """Every row's `detect` runs in the merge's head start, before `import torch`."""
    code = (
        "import sys; from pathlib import Path; from shardforge.formats.registry import detect; "
        "detect(Path('.')); print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr


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
def test_detects_its_own_folders_only(
    fmt: CheckpointFormat, written: dict[str, tuple[Path, Tensors]]
) -> None:
    """A sharded format recognises its folders and no other format's; the registry's `detect`
    gives each folder its own format (the DCP safetensors row comes before the plain
    safetensors one, which may read a consolidated folder's HF files too)."""
    for name, (folder, _) in written.items():
        own = _format_of(name) == fmt.name
        if own or fmt.sharded:
            assert fmt.detect(folder) == own, (fmt.name, name)
        assert detect(folder, sharded_only=False) is format_named(_format_of(name)), name


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_open_and_describe_agree_with_what_was_written(
    fmt: CheckpointFormat, written: dict[str, tuple[Path, Tensors]]
) -> None:
    for fixture in _own(fmt):
        folder, tensors = written[fixture]
        named = fmt.open(folder)
        assert sorted(named) == sorted(tensors), fixture
        for key, n in named.items():
            want = (tuple(tensors[key].shape), tensors[key].dtype)
            assert (n.shape, n.dtype) == want, (fixture, key)
        contents = fmt.describe(folder)
        assert isinstance(contents, Contents) and contents.storage == fmt.name
        facts = {t.name: t for t in contents.tensors}
        assert sorted(facts) == sorted(tensors)
        for key, t in tensors.items():
            assert facts[key].shape == tuple(t.shape) and facts[key].numel == t.numel()
            assert facts[key].nbytes == math.prod(t.shape) * t.element_size()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_shard_files_exist_inside_the_folder(
    fmt: CheckpointFormat, written: dict[str, tuple[Path, Tensors]]
) -> None:
    for fixture in _own(fmt):
        folder, _ = written[fixture]
        files = fmt.shard_files(folder)
        assert files, fixture
        for rel in files:
            assert not rel.is_absolute() and ".." not in rel.parts
            assert (folder / rel).is_file(), (fixture, rel)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_identity_lists_the_files_read_with_their_sizes_and_records(
    fmt: CheckpointFormat, written: dict[str, tuple[Path, Tensors]]
) -> None:
    """What an output's manifest records of its checkpoint (`sinks.manifest`): every file the
    stored tensors live in, its size, and each record's stored CRC-32s as Python's zipfile
    reads them."""
    import io
    import zipfile

    for fixture in _own(fmt):
        folder, _ = written[fixture]
        locations = {s.directory for n in fmt.open(folder).values() for s in n.source.stored()}
        for location in locations:
            base = location if location.is_dir() else location.parent
            files = fmt.identity(location)
            assert files, fixture
            for f in files:
                data = (base / f.path).read_bytes()
                assert not f.path.is_absolute() and f.size == len(data), (fixture, f.path)
                for r in f.records:
                    window = io.BytesIO(data[r.offset : r.offset + r.length])
                    with zipfile.ZipFile(window) as z:
                        assert {m: z.getinfo(m).CRC for m, _ in r.crc32} == dict(r.crc32)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_files_are_named_alike_however_the_folder_is_spelled(
    fmt: CheckpointFormat,
    written: dict[str, tuple[Path, Tensors]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A merge parses a file's facts once (`fact_session`, keyed by the absolute path) and may
    name the folder relative to the working directory in one step (`make demo`'s output_dir)
    and absolute in another (the manifest's identity, the shard removal): `shard_files` and
    `identity` name the same files either way, in either order."""
    from shardforge.io.copy import fact_session

    for fixture in _own(fmt):
        folder, _ = written[fixture]
        monkeypatch.chdir(folder.parent)
        spellings = [Path(folder.name), folder.absolute()]
        for first, then in (spellings, spellings[::-1]):
            with fact_session():
                opened = fmt.open(first)
                files = fmt.shard_files(then)
                locations = {s.directory for n in opened.values() for s in n.source.stored()}
                for location in locations:
                    named = [f.path for f in fmt.identity(location)]
                    other = location if location.is_absolute() else location.absolute()
                    assert named == [f.path for f in fmt.identity(other)], (fixture, first)
            assert files == fmt.shard_files(folder), (fixture, first)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_reference_reader_gives_what_the_source_reads(
    fmt: CheckpointFormat, written: dict[str, tuple[Path, Tensors]]
) -> None:
    for fixture in _own(fmt):
        folder, tensors = written[fixture]
        named = fmt.open(folder)
        with ReadCache() as reader:
            for key, n in named.items():
                (stored,) = n.source.stored()
                assert stored.fmt == fmt.name
                ref = fmt.reference(stored.directory)
                ref.check_crcs({stored.key})
                got = ref.load([stored])[stored.key]
                ours = n.source.read(reader)
                assert same_bytes(got, ours), (fixture, key)
                assert same_bytes(ours, tensors[key]), (fixture, key)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bytes (bool included)."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(*flat)
