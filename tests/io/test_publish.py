"""Publishing re-checks the output path at the rename: of two merges racing to one path exactly
one publishes and the other fails with a clear error and leaves nothing; a file written into the
output directory while a merge runs is kept (without --overwrite); a temporary directory left by
a merge killed with `kill -9` is removed by the next merge to that path, a live one's never."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shardforge.errors import MergeError
from shardforge.io.lock import OutputLocked
from shardforge.io.publish import atomic_directory, atomic_file, remove_stale_temps
from shardforge.merge.api import merge_fsdp_weights
from test_inspection import Built, build_checkpoints

APPEARED = "appeared while the merge ran"
ROUNDS = 25


def race(out: Path, publish: str, existing: str | None) -> list[str | Exception]:
    """Two threads write `out` at once and both reach the rename together (a barrier at the
    end of the body, the moment before publishing). Each thread's result: its tag or error."""
    barrier = threading.Barrier(2)
    results: list[str | Exception] = ["", ""]

    def one(i: int) -> None:
        try:
            if publish == "dir":
                with atomic_directory(out) as tmp:
                    (tmp / "who").write_text(str(i))
                    barrier.wait(timeout=10)
            else:
                with atomic_file(out) as tmp:
                    (tmp / out.name).write_text(str(i))
                    barrier.wait(timeout=10)
            results[i] = str(i)
        except Exception as exc:
            results[i] = exc

    if existing == "empty dir":
        out.mkdir()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize(
    ("publish", "existing"), [("dir", None), ("dir", "empty dir"), ("file", None)]
)
def test_of_two_racing_publishers_exactly_one_wins(
    tmp_path: Path, publish: str, existing: str | None
) -> None:
    for n in range(ROUNDS):
        out = tmp_path / f"r{n}" / ("out" if publish == "dir" else "model.safetensors")
        out.parent.mkdir()
        results = race(out, publish, existing)
        won = [r for r in results if isinstance(r, str)]
        lost = [r for r in results if isinstance(r, Exception)]
        assert len(won) == 1 and len(lost) == 1, results
        assert isinstance(lost[0], MergeError) and APPEARED in str(lost[0])
        written = (out / "who") if publish == "dir" else out
        assert written.read_text() == won[0]  # the winner's output, whole
        assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary left


def test_a_file_written_into_the_output_meanwhile_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()  # empty: accepted at the start
    with pytest.raises(MergeError, match=APPEARED), atomic_directory(out) as tmp:
        (tmp / "model.safetensors").write_text("merged")
        (out / "notes.txt").write_text("written by someone else during the merge")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # with overwrite it is replaced, atomically
    with atomic_directory(out, overwrite=True) as tmp:
        (tmp / "model.safetensors").write_text("merged")
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # a file where the output file goes
    single = tmp_path / "one.safetensors"
    with pytest.raises(MergeError, match=APPEARED), atomic_file(single) as tmp:
        (tmp / single.name).write_text("merged")
        single.write_text("theirs")
    assert single.read_text() == "theirs"


HOLD = """
import sys, time
from pathlib import Path
from shardforge.io.publish import atomic_directory
with atomic_directory(Path(sys.argv[1])) as tmp:
    (tmp / "partial").write_text("x")
    print(tmp, flush=True)
    time.sleep(120)
"""


def _holder(out: Path) -> tuple[subprocess.Popen[str], Path]:
    """A process in the middle of writing `out` (its temporary directory made, a file in it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


@pytest.mark.slow
def test_a_killed_merges_temporary_is_removed_by_the_next(tmp_path: Path) -> None:
    out = tmp_path / "out"
    killed, stale = _holder(out)
    live, running = _holder(out)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert stale.is_dir() and running.is_dir()
        # what a pid reused by another process, or an older shardforge, leaves
        boot, pid, start = running.name.split(".tmp-", 1)[1].split("-")[:3]
        reused = tmp_path / f".out.tmp-{boot}-{pid}-{int(start) + 1}-abc"
        legacy = tmp_path / f".out.tmp-{killed.pid}"
        other = tmp_path / f".elsewhere.tmp-{boot}-{killed.pid}-1-abc"  # another output's
        for d in (reused, legacy, other):
            d.mkdir()
        with atomic_directory(out) as tmp:
            (tmp / "f").write_text("new")
        assert (out / "f").read_text() == "new"
        assert not stale.exists() and not reused.exists() and not legacy.exists()
        assert running.is_dir() and (running / "partial").is_file()  # its owner is alive
        assert other.is_dir()
        assert remove_stale_temps(out) == []
    finally:
        live.kill()
        live.wait(timeout=30)


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


@pytest.mark.slow
def test_two_concurrent_merges_to_one_path(built: Built, tmp_path: Path) -> None:
    """Two merges through the Python API at once, to one output: exactly one publishes, the
    other fails with one clear error (the output's lock held by the first, the output there
    already, or at the rename) and leaves nothing."""
    out = tmp_path / "merged"
    cfg = {"base_model": str(built.base), "output_dir": str(built.ours)}
    results: list[Path | Exception] = [out, out]

    def one(i: int) -> None:
        try:
            results[i] = merge_fsdp_weights(cfg, out, quiet=True)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, Exception)]
    assert len(errors) == 1, results
    assert isinstance(errors[0], MergeError | OutputLocked)
    assert any(m in str(errors[0]) for m in (APPEARED, "exists and is not empty", "in use by"))
    assert (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]


@pytest.mark.parametrize("umask,mode", [(0o022, 0o755), (0o027, 0o750), (0o002, 0o775)])
def test_merged_and_prepared_folders_follow_the_umask(
    umask: int, mode: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`merge-sharded-fsdp-weights` and `preprocess` as a user runs them: the folders they
    publish have the mode mkdir gives under the umask (not mkdtemp's drwx------)."""
    import os
    import stat

    import yaml
    from click.testing import CliRunner

    from helpers.keep import make_keep_checkpoint
    from shardforge.cli.main import cli

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # the example's relative paths
    base, ckpt = make_keep_checkpoint(tmp_path)
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(base), "output_dir": str(tmp_path / "run")}))
    merged, prepared = tmp_path / "merged", tmp_path / "prepared"
    old = os.umask(umask)
    try:
        merge = ["merge-sharded-fsdp-weights", cfg, "--checkpoint", ckpt, "--output_path", merged]
        merge.append("--no_save_tokenizer")  # the checkpoint's base has none
        example = ["preprocess", "examples/tiny-llama.yml", "--dataset_prepared_path", prepared]
        for args in (merge, example):
            result = CliRunner().invoke(cli, [str(a) for a in args])
            assert result.exit_code == 0, result.output
    finally:
        os.umask(old)
    (folder,) = [p for p in prepared.iterdir() if p.is_dir()]
    for path in (merged, folder):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    # every file in them too, the weights (written by the merge's own copy) included
    files = [p for p in (*merged.iterdir(), *folder.iterdir()) if p.is_file()]
    assert merged / "model.safetensors" in files
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == mode & 0o666, path
