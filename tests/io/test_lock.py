"""The one-writer lock of an output (io/lock.py): a second writer is refused naming the holder,
a lock left by a writer that has ended is taken over with a notice, another host's only when
asked; the lock file is gone once its holder lets go.

The holders here are real: this process (a second flock on the file is refused as another
process's would be), the test's parent process (alive, of this host), a pid that cannot exist
(above the kernel's pid_max), this pid with another start time (a reused pid). Locks held by
other processes (merge and training ranks) and freed by SIGKILL are in
tests/merge/test_distributed.py and tests/train/test_launch.py.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest

from shardforge.io import lock
from shardforge.io.lock import OutputLocked, lock_beside, lock_inside, output_lock


def _pid_max() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def _left(path: Path, **changes: object) -> None:
    """A lock file as a writer of this host leaves it when it is killed (then `changes`)."""
    holder = {**lock.me("shardforge train (rank 0 of 2)").__dict__, **changes}
    path.write_text(json.dumps(holder) + "\n")


def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    out = tmp_path / "merged"
    path = lock_beside(out)
    assert path == tmp_path / "merged.shardforge.lock"
    with output_lock(path, out, "shardforge merge-sharded-fsdp-weights") as holder:
        assert json.loads(path.read_text())["pid"] == os.getpid() == holder.pid
        with pytest.raises(OutputLocked) as info, output_lock(path, out, "a second merge"):
            pytest.fail("two writers held one output")
        line = info.value.lines()[0]
        assert line.startswith("error: ") and len(line) <= 300, line
        assert f"pid {os.getpid()} on {socket.gethostname()}" in line, line
        assert "shardforge merge-sharded-fsdp-weights" in line and "it is running" in line, line
        assert str(path) in str(info.value)
    assert not path.exists()  # released: the file is gone
    with output_lock(path, out, "the next merge"):  # and the output can be taken again
        pass


def test_a_lock_of_a_dead_pid_is_taken_over_with_a_notice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    path = lock_inside(run)
    _left(path, pid=_pid_max() + 1)  # no process can have it
    taken = output_lock(path, run, "shardforge train (rank 0 of 2)", option="--take_over_lock")
    with caplog.at_level(logging.WARNING, logger="shardforge"), taken:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    notices = [r.getMessage() for r in caplog.records]
    assert any("taking over the lock of a writer that has ended" in m for m in notices), notices
    assert not path.exists()


def test_a_lock_still_flocked_by_a_writer_that_has_ended_is_taken_once_it_lets_go(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed writer shows as ended (a zombie) while its last threads still hold its files,
    and so its flock, for a moment: the next writer waits for that moment, not refuses."""
    import fcntl
    import threading

    out = tmp_path / "merged"
    path = lock_beside(out)
    _left(path, pid=_pid_max() + 1)  # the holder named has ended ...
    held = os.open(path, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # ... but its files are not closed yet
    threading.Timer(0.5, os.close, (held,)).start()
    with caplog.at_level(logging.WARNING, logger="shardforge"), output_lock(path, out, "next"):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert any("taking over the lock" in r.getMessage() for r in caplog.records)


def test_a_reused_pid_or_another_boot_is_a_writer_that_has_ended(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The pid runs, but it is not the process that took the lock: another start time, or a
    lock from before a reboot."""
    path = tmp_path / "out.shardforge.lock"
    parent = os.getppid()
    for changes in (
        {"pid": parent, "start": "1"},
        {"pid": parent, "start": lock._start_time(parent), "boot": "another-boot"},
    ):
        _left(path, **changes)
        caplog.clear()
        taken = output_lock(path, tmp_path / "out", "merge")
        with caplog.at_level(logging.WARNING, logger="shardforge"), taken:
            pass
        assert any("has ended" in r.getMessage() for r in caplog.records), changes


def test_a_running_writer_of_this_host_is_refused_even_without_its_flock(tmp_path: Path) -> None:
    """The file names a process of this host that runs, with its own start time (the test's
    parent): it holds the output, whether or not this file system carried its flock."""
    path = tmp_path / "out.shardforge.lock"
    parent = os.getppid()
    _left(path, pid=parent, start=lock._start_time(parent))
    refused = pytest.raises(OutputLocked, match=rf"pid {parent} on .*it is running")
    with refused, output_lock(path, tmp_path / "out", "merge", take_over=True):
        pytest.fail("took a running writer's lock")
    assert json.loads(path.read_text())["pid"] == parent  # left as it was


def test_another_hosts_lock_is_taken_only_when_asked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "out.shardforge.lock"
    _left(path, host="node-7", pid=12345)
    taken = output_lock(path, tmp_path / "out", "merge", option="--take_over_lock")
    with pytest.raises(OutputLocked) as info, taken:
        pytest.fail("took another host's lock without being asked")
    line = info.value.lines()[0]
    assert "pid 12345 on node-7" in line and "--take_over_lock" in line, line
    assert json.loads(path.read_text())["host"] == "node-7"
    taken = output_lock(path, tmp_path / "out", "merge", take_over=True, option="--x")
    with caplog.at_level(logging.WARNING, logger="shardforge"), taken:
        assert json.loads(path.read_text())["host"] == socket.gethostname()
    assert any("taking over the lock of" in r.getMessage() for r in caplog.records)
    assert not path.exists()


@pytest.mark.parametrize(
    "content", ["", "not json", "[1, 2]", '{"host": "h"}', "[" * 4000, "\xff\xfe"]
)
def test_an_empty_or_unreadable_lock_file_is_taken(tmp_path: Path, content: str) -> None:
    """Its writer died before it wrote its line (nothing else holds the flock)."""
    path = tmp_path / "out.shardforge.lock"
    path.write_text(content)
    with output_lock(path, tmp_path / "out", "merge"):
        assert json.loads(path.read_text())["pid"] == os.getpid()


def test_the_folder_is_made_as_publishing_makes_it_or_the_lock_is_one_error(
    tmp_path: Path,
) -> None:
    out = tmp_path / "new" / "deeper" / "out"
    with output_lock(lock_beside(out), out, "merge"):
        assert lock_beside(out).is_file()
    (tmp_path / "a-file").write_text("")
    taken = output_lock(tmp_path / "a-file" / "out.shardforge.lock", tmp_path, "merge")
    with pytest.raises(lock.ShardforgeError, match="cannot take its lock file"), taken:
        pass


def test_a_file_system_without_flock_keeps_a_running_writer_out_by_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """flock refused as unsupported (ENOLCK, as some network file systems answer): said once,
    and the lock file alone still refuses a running writer and names the holder."""
    import errno

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_flock)
    path = tmp_path / "out.shardforge.lock"
    first = output_lock(path, tmp_path / "out", "merge")
    with caplog.at_level(logging.WARNING, logger="shardforge"), first:
        second = output_lock(path, tmp_path / "out", "a second merge")
        with pytest.raises(OutputLocked, match=rf"pid {os.getpid()} .*it is running"), second:
            pytest.fail("two writers held one output")
    assert any("cannot lock files" in r.getMessage() for r in caplog.records)
    assert not path.exists()


@pytest.mark.parametrize("pid", [10**30, -(10**30), 0, -1, 2**31, "12", True, 1.5])
def test_a_damaged_pid_is_an_unreadable_lock_taken_over_with_a_notice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pid: object
) -> None:
    """A pid no process can have (too large for the kernel, zero or negative: kill(0) and
    kill(-1) would ask about a whole group) names no holder: taken over with a line that says
    the file is damaged, never an OverflowError on every later merge."""
    path = tmp_path / "out.shardforge.lock"
    _left(path, pid=pid)
    taken = output_lock(path, tmp_path / "out", "merge")
    with caplog.at_level(logging.WARNING, logger="shardforge"), taken:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    notices = [r.getMessage() for r in caplog.records]
    assert any(f"its lock file {path} holds no lock line" in m for m in notices), notices
    assert not path.exists()


def test_a_lock_file_hard_linked_to_another_file_is_replaced_not_written_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("mine\n")
    path = tmp_path / "out.shardforge.lock"
    os.link(precious, path)
    taken = output_lock(path, tmp_path / "out", "merge")
    with caplog.at_level(logging.WARNING, logger="shardforge"), taken:
        assert json.loads(path.read_text())["pid"] == os.getpid()
        assert path.stat().st_nlink == 1 and not os.path.samefile(path, precious)
    assert precious.read_text() == "mine\n" and precious.stat().st_nlink == 1
    assert not path.exists()
    notices = [r.getMessage() for r in caplog.records]
    assert any("is a hard link to another file" in m for m in notices), notices


@pytest.mark.parametrize("kind", ["fifo", "symlink", "dangling symlink", "directory"])
def test_a_lock_file_that_is_not_a_regular_file_is_one_error_naming_it(
    tmp_path: Path, kind: str
) -> None:
    """Never followed, never waited on (a FIFO opened for writing would block without a
    reader): one error line naming the lock file; what it points to is left as it is."""
    path = tmp_path / "out.shardforge.lock"
    target = tmp_path / "target.txt"
    target.write_text("mine\n")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        os.symlink(target if kind == "symlink" else tmp_path / "nowhere", path)
    with pytest.raises(lock.ShardforgeError) as info, output_lock(path, tmp_path / "out", "m"):
        pytest.fail("taken")
    line = info.value.lines()[0]
    assert line.startswith("error: ") and len(line) <= 300 and str(path) in line, line
    assert "not a file shardforge wrote; remove it" in line, line
    assert target.read_text() == "mine\n" and not (tmp_path / "nowhere").exists()
