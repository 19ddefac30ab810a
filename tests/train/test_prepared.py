"""Prepared data sets: written once, reused while the hash matches, prepared again (with the
reason) when an input changed or the folder is damaged, never read damaged; on several ranks one
process per node prepares; `preprocess` then `train` trains exactly as `train` alone."""

from __future__ import annotations

import errno
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from train_helpers import EVALUATED, launch_train, read_metrics, shared_run, write_config

from helpers.dist import run_on_ranks
from helpers.tiny import make_tokenizer, tiny_texts, write_jsonl
from shardforge.config import load_cfg, validate_cfg
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError, ShardforgeError
from shardforge.train import prepared
from shardforge.train.data import load_tokenizer
from shardforge.train.eval import Datasets, build_datasets
from shardforge.train.prepared_key import file_sha256
from shardforge.train.runtime import Runtime


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    make_tokenizer(320).save_pretrained(root / "tok")
    write_jsonl(root / "texts.jsonl", [{"text": t} for t in tiny_texts(40, seed=4)])
    return root


def _config(root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "base_model": str(root / "tok"),
        "datasets": [{"path": str(root / "texts.jsonl"), "type": "completion"}],
        "sequence_len": 32,
        "sample_packing": True,
        "val_set_size": 0.2,
        **extra,
    }


def _cfg(root: Path, **extra: Any) -> ShardforgeConfig:
    return validate_cfg(_config(root, **extra))


def assert_same(got: Datasets, want: Datasets) -> None:
    """Every tensor of both splits equal (values, dtype, shape), the same evaluation key."""
    assert got.eval_key == want.eval_key
    for a, b in ((got.train, want.train), (got.eval, want.eval)):
        assert (a is None) == (b is None)
        if a is None or b is None:
            continue
        for name in prepared.COLUMNS:
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert x.dtype == y.dtype and torch.equal(x, y), name


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_prepare_writes_then_reuses_the_same_sequences(
    data_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(data_root)
    tok = load_tokenizer(cfg)
    want = build_datasets(cfg, tok)
    with caplog.at_level(logging.INFO, logger="shardforge"):
        first = prepared.prepare(cfg, tok, tmp_path / "prep")
        second = prepared.prepare(cfg, tok, tmp_path / "prep")
    assert first.built and not second.built
    assert first.folder == second.folder == tmp_path / "prep" / first.hash
    assert_same(first.data, want)
    assert_same(second.data, want)
    assert want.train.position_ids is not None and want.eval is not None  # packed, held out
    said = _messages(caplog)
    assert said[0].startswith(f"preparing the data sets into {first.folder} (hash {first.hash})")
    assert said[-1] == f"using prepared dataset at {first.folder} (hash {first.hash})"

    manifest = json.loads((first.folder / prepared.MANIFEST).read_text())
    on_disk = {
        p.relative_to(first.folder).as_posix()
        for p in first.folder.rglob("*")
        if p.is_file() and p.name != prepared.MANIFEST
    }
    assert set(manifest["files"]) == on_disk and "train/dataset_info.json" in on_disk
    for name, entry in manifest["files"].items():
        path = first.folder / name
        assert entry == {"size": path.stat().st_size, "sha256": file_sha256(path)}
    assert manifest["hash"] == first.hash and manifest["sequences"] == {
        "train": len(want.train),
        "eval": len(want.eval),
    }
    # the library reads it back as the DatasetDict it is
    import datasets

    loaded = datasets.load_from_disk(str(first.folder))
    assert loaded["train"].num_rows == len(want.train)


def _arrow(folder: Path) -> Path:
    return next((folder / "train").glob("*.arrow"))


def _truncate(folder: Path) -> None:
    path = _arrow(folder)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(folder: Path) -> None:
    path = _arrow(folder)
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF
    path.write_bytes(bytes(data))


def _rehash(folder: Path) -> None:
    path = folder / prepared.MANIFEST
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "hash": "0" * 16}))


DAMAGE = {
    "truncated": (
        _truncate,
        r"train/data-00000-of-00001\.arrow has \d+ bytes, \d+ expected \(trun",
    ),
    "changed": (_flip_a_byte, r"train/data-00000-of-00001\.arrow does not match its sha256"),
    "missing": (lambda f: (f / "eval" / "state.json").unlink(), r"eval/state\.json is missing"),
    "no manifest": (lambda f: (f / prepared.MANIFEST).unlink(), r"manifest\.json is missing"),
    "foreign": (_rehash, r"it holds the data of hash '0000000000000000', not [0-9a-f]{16}"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_folder_is_prepared_again_never_read(
    damage: str,
    data_root: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = _cfg(data_root)
    tok = load_tokenizer(cfg)
    folder = prepared.prepare(cfg, tok, tmp_path).folder
    spoil, reason = DAMAGE[damage]
    spoil(folder)
    monkeypatch.setattr(prepared, "read", lambda f: pytest.fail(f"read the damaged {f}"))
    with caplog.at_level(logging.INFO, logger="shardforge"):
        again = prepared.prepare(cfg, tok, tmp_path)
    assert again.built and again.folder == folder
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert warned[0].startswith(f"warning: the prepared dataset at {folder} is damaged (")
    assert re.search(reason, warned[0]), warned[0]
    assert warned[0].endswith("; preparing it again")
    assert_same(again.data, build_datasets(cfg, tok))
    assert prepared.problem(folder) is None


def test_a_changed_key_prepares_anew_and_says_why(
    data_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = prepared.prepare(_cfg(data_root), load_tokenizer(_cfg(data_root)), tmp_path)
    cfg = _cfg(data_root, sequence_len=48)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardforge"):
        second = prepared.prepare(cfg, load_tokenizer(cfg), tmp_path)
    assert second.built and second.hash != first.hash
    assert _messages(caplog)[0] == (
        f"preparing the data sets into {second.folder} (hash {second.hash}), as inputs changed "
        f"since {first.folder}: sequence_len: 32 -> 48"
    )
    assert second.data.train.input_ids.shape[1] == 48
    assert prepared.problem(first.folder) is None  # each hash keeps its folder


def test_a_failed_write_leaves_nothing_and_names_the_key(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(data_root)
    save = prepared._save_splits

    def disk_full(folder: Path, data: Datasets) -> None:
        save(folder, data)
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "x"))

    monkeypatch.setattr(prepared, "_save_splits", disk_full)
    with pytest.raises(ConfigError) as err:
        prepared.prepare(cfg, load_tokenizer(cfg), tmp_path / "prep")
    assert err.value.message.startswith(
        f"dataset_prepared_path: cannot write the prepared data sets to {tmp_path / 'prep'}/"
    )
    assert "(No space left on device)" in err.value.message
    left = list((tmp_path / "prep").iterdir())  # the lock file, no folder, no temporary one
    assert len(left) == 1 and re.fullmatch(r"\.[0-9a-f]{16}\.lock", left[0].name), left

    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"^dataset_prepared_path: cannot create .*a-file"):
        prepared.prepare(cfg, load_tokenizer(cfg), tmp_path / "a-file")


def test_a_folder_it_cannot_write_is_still_read(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a read-only file system no lock can be taken; an intact prepared folder is reused."""
    cfg = _cfg(data_root)
    tok = load_tokenizer(cfg)
    first = prepared.prepare(cfg, tok, tmp_path)
    (tmp_path / f".{first.hash}.lock").unlink()
    opened = Path.open

    def read_only(path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if path.name.endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return opened(path, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", read_only)
    again = prepared.prepare(cfg, tok, tmp_path)
    assert not again.built and again.folder == first.folder
    assert_same(again.data, first.data)


# ---------------------------------------------------------------------------------------------
# several ranks


def _prepare_on_ranks(rank: int, world: int, root: str, out: str) -> None:
    """Rank `rank` of a 2-rank group, in scenarios the test reads back from `out`:
    `node`: both ranks on one node (local ranks 0, 1); then a truncated file and a changed key;
    `nodes`: each rank local rank 0 of its own node, one shared folder;
    `bad`: a row the data set type cannot use."""
    import torch.distributed as dist

    handler = logging.FileHandler(Path(out) / f"log-{rank}")
    logger = logging.getLogger("shardforge")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    cfg = _cfg(Path(root), dataset_prepared_path=str(Path(out) / "node"))
    tok = load_tokenizer(cfg)
    rt = Runtime(rank, world, rank, torch.device("cpu"))
    results = {"node": prepared.prepared_datasets(cfg, tok, rt)}
    dist.barrier()
    if rank == 0:
        _truncate(next(p for p in (Path(out) / "node").iterdir() if p.is_dir()))
    dist.barrier()
    results["truncated"] = prepared.prepared_datasets(cfg, tok, rt)
    longer = _cfg(Path(root), dataset_prepared_path=cfg.dataset_prepared_path, sequence_len=48)
    results["longer"] = prepared.prepared_datasets(longer, tok, rt)
    logger.info("-- nodes")
    shared = _cfg(Path(root), dataset_prepared_path=str(Path(out) / "shared"))
    results["nodes"] = prepared.prepared_datasets(shared, tok, Runtime(rank, world, 0, rt.device))
    logger.info("-- bad")
    bad = _cfg(Path(root), datasets=[{"path": str(Path(root) / "bad.jsonl")}])
    bad = validate_cfg({**bad.to_dict(), "dataset_prepared_path": str(Path(out) / "bad")})
    try:
        prepared.prepared_datasets(bad, tok, rt)
    except ShardforgeError as exc:
        logger.info("raised: %s", exc)
    torch.save(
        {k: {n: getattr(v.train, n) for n in prepared.COLUMNS} for k, v in results.items()},
        Path(out) / f"data-{rank}.pt",
    )
    logger.removeHandler(handler)
    handler.close()


@pytest.mark.slow
def test_one_process_per_node_prepares_and_the_others_wait(data_root: Path, tmp_path: Path) -> None:
    write_jsonl(data_root / "bad.jsonl", [{"text": "ok"}, {"body": "no text"}])
    run_on_ranks(_prepare_on_ranks, 2, str(data_root), str(tmp_path))
    logs = [(tmp_path / f"log-{r}").read_text().split("-- nodes\n") for r in (0, 1)]
    node0, node1 = logs[0][0], logs[1][0]
    # one node: rank 0 prepared, warned about the truncated file, said why it prepared anew;
    # rank 1 only waited and read
    assert node0.count("preparing the data sets into") == 2
    assert "as inputs changed since" in node0 and "sequence_len: 32 -> 48" in node0
    assert node0.count("is damaged (train/data-00000-of-00001.arrow has ") == 1
    assert "preparing" not in node1 and "damaged" not in node1
    # two nodes sharing one folder: they took turns, the first prepared, the second reused
    nodes = [log[1].split("-- bad\n") for log in logs]
    built = [n[0].count("preparing the data sets into") for n in nodes]
    reused = [n[0].count("using prepared dataset at") for n in nodes]
    assert sorted(built) == [0, 1] and sorted(reused) == [0, 1] and built != reused
    # a row rank 0 cannot use: both ranks stop on its error
    for node in nodes:
        assert "raised: datasets[0].field: row 2 of " in node[1]

    ref_cfg = _cfg(data_root)
    tok = load_tokenizer(ref_cfg)
    want = {
        "node": build_datasets(ref_cfg, tok),
        "longer": build_datasets(_cfg(data_root, sequence_len=48), tok),
    }
    want["truncated"] = want["nodes"] = want["node"]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"data-{rank}.pt", weights_only=True)
        for scenario, data in want.items():
            for name in prepared.COLUMNS:
                assert torch.equal(got[scenario][name], getattr(data.train, name)), (rank, name)


# ---------------------------------------------------------------------------------------------
# preprocess, then train on 2 ranks


@pytest.fixture(scope="module")
def runs(base_cfg: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same 2-rank run without dataset_prepared_path (`shared_run`), and after `preprocess`
    with it (`launch_train`: torchrun)."""
    from shardforge.cli.main import cli

    root = tmp_path_factory.mktemp("prepared-runs")
    plain = shared_run(tmp_path_factory, "evaluated")
    cfg = {**base_cfg, **EVALUATED}
    with_cache = {**cfg, "output_dir": str(root / "b"), "dataset_prepared_path": str(root / "p")}
    config = write_config(root / "cached.yml", with_cache)
    pre = CliRunner().invoke(cli, ["preprocess", str(config)])
    assert pre.exit_code == 0, pre.output
    cached = launch_train(config)
    return {
        "root": root,
        "config": config,
        "plain": (plain.out, plain.stderr),
        "cached": (root / "b", cached),
        "preprocess": pre.stdout,
    }


@pytest.mark.slow
def test_train_reuses_what_preprocess_prepared_and_trains_the_same(runs: dict[str, Any]) -> None:
    (folder,) = [p for p in (runs["root"] / "p").iterdir() if p.is_dir()]
    assert runs["preprocess"] == (
        f"prepared dataset {folder} (written): 75 training sequences of 32 tokens, "
        "9 evaluation sequences (val_set_size)\n"
    )
    out, stderr = runs["cached"]
    assert f"using prepared dataset at {folder} (hash {folder.name})\n" in stderr
    assert "preparing" not in stderr and "prepared dataset" not in runs["plain"][1]
    want = read_metrics(runs["plain"][0])
    got = read_metrics(out)
    keys = ("step", "loss", "grad_norm", "tokens", "eval_loss")
    assert [{k: m.get(k) for k in keys} for m in got] == [{k: m.get(k) for k in keys} for m in want]
    assert [m["step"] for m in got if "loss" in m] == [1, 2, 3, 4, 5]
    assert any("eval_loss" in m for m in got)
    assert load_cfg(runs["config"], command="train").dataset_prepared_path == str(
        runs["root"] / "p"
    )
