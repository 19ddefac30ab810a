"""Every user error is one printable `error:` line of at most 300 characters (long absolute
paths shortened in the middle, file names kept), naming the specific problem, with at most 20
indented detail lines and "(+N more)"; names read from checkpoint files are sanitized; output
side file-system errors (disk full, file too large, read-only, a parent that is a file) are one
line too; a YAML alias bomb is refused in well under a second."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from helpers.tiny import make_model
from shardforge.cli.main import cli
from shardforge.errors import MAX_DETAILS, MAX_LINE, format_error, shorten_path

CMD = "merge-sharded-fsdp-weights"
# a deep folder: every absolute path below it is over 200 characters
DEEP = tuple(f"{i}-a-rather-long-folder-name-" * 3 for i in range(4))
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred"


def check_lines(stderr: str) -> tuple[str, list[str]]:
    """The `error:` line and its details, checked: one error line, at most MAX_LINE
    characters, at most MAX_DETAILS details and a "(+N more)", all printable, no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(errors) == 1, stderr
    head, details = lines[errors[0]], lines[errors[0] + 1 :]
    assert len(head) <= MAX_LINE, head
    assert all(d.startswith("  ") and len(d) <= MAX_LINE for d in details), details
    assert len(details) <= MAX_DETAILS + 1
    if len(details) == MAX_DETAILS + 1:
        assert details[-1].strip().startswith("(+") and details[-1].endswith(" more)")
    assert all(line.isprintable() for line in [head, *details])
    assert "Traceback" not in stderr
    return head, details


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run (one DCP save of a tiny Llama, shardforge layout) in a deep folder, a model of
    another shape, and a checkpoint with a key holding terminal escape sequences."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lines").joinpath(*DEEP)
    base = make_model(root / "base", "llama", vocab_size=320)
    make_model(root / "other", "llama", vocab_size=320, hidden_size=32, num_attention_heads=2)
    sd = AutoModelForCausalLM.from_pretrained(base).state_dict()
    ckpt = root / "run" / "checkpoint-1"
    dcp.save(sd, checkpoint_id=ckpt / "model", no_dist=True)
    (ckpt / "trainer_state.json").write_text("{}")
    evil = {**sd, f"model.{ESCAPES}{'n' * 400}": torch.zeros(2)}
    dcp.save(evil, checkpoint_id=root / "evil" / "model", no_dist=True)
    (root / "unfinished" / "checkpoint-4" / "pytorch_model_fsdp_0").mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp"):
        shutil.copy(
            ckpt / "model" / "__0_0.distcp",
            root / "unfinished" / "checkpoint-4" / "pytorch_model_fsdp_0" / name,
        )
    return root


def merge(root: Path, *args: str, base: str = "base", run: str = "run") -> Any:
    cfg = root / f"cfg-{base}-{run}.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(root / base), "output_dir": str(root / run)}))
    return CliRunner().invoke(cli, [CMD, str(cfg), "--quiet", *args])


def test_bad_inputs_under_long_paths_are_one_short_line(deep: Path, tmp_path: Path) -> None:
    (deep / "full").mkdir(exist_ok=True)
    (deep / "full" / "keep.txt").write_text("mine")
    model_dir = deep / "run" / "checkpoint-1" / "model"
    cases = {
        "unfinished": (
            merge(deep, "--output_path", str(deep / "o1"), run="unfinished"),
            "checkpoint-4/pytorch_model_fsdp_0 has .distcp files but no .metadata: the save did "
            "not finish",
        ),
        "missing": (
            merge(deep, "--output_path", str(deep / "o2"), "--checkpoint", str(deep / "nope")),
            "/nope: checkpoint path does not exist",
        ),
        "exists": (
            merge(deep, "--output_path", str(deep / "full")),
            "/full: output directory exists and is not empty; pass --overwrite",
        ),
        "overlap": (
            merge(deep, "--output_path", str(model_dir / "merged")),
            "the output path overlaps the checkpoint",
        ),
        "mismatch": (
            merge(deep, "--output_path", str(deep / "o3"), base="other"),
            "does not match the architecture",
        ),
        "escapes": (
            merge(deep, "--output_path", str(deep / "o4"), run="evil"),
            "1 unexpected",
        ),
    }
    for name, (result, words) in cases.items():
        assert result.exit_code != 0, (name, result.output)
        head, details = check_lines(result.stderr)
        assert words in head, (name, head)
        assert len(str(deep)) > MAX_LINE and "/.../" in head, (name, head)
        if name == "mismatch":
            assert details[-1].strip().startswith("(+") and "shape mismatch" in details[0]
        if name == "escapes":
            assert "\x1b" not in result.stderr and "\\x1b]0;pwned\\x07" in details[0]
    assert (deep / "full" / "keep.txt").read_text() == "mine"
    assert not any(p.name.startswith(("o1", "o2", "o3", "o4", ".o")) for p in deep.iterdir())


def test_the_formatter_keeps_file_names_and_ends() -> None:
    path = "/" + "/".join(f"folder-number-{i}" for i in range(40)) + "/__0_0.distcp"
    short = shorten_path(path, 60)
    assert (
        len(short) <= 60
        and short.startswith("/folder-number-0/...")
        and short.endswith("/__0_0.distcp")
    )
    message = f"{path}: truncated; the checkpoint is incomplete or was cut off while copying"
    (head,) = format_error(message)
    assert len(head) <= MAX_LINE and head.endswith("cut off while copying")
    assert "__0_0.distcp: truncated" in head
    lines = format_error("bad\x1b[2J", [f"item {i}" for i in range(50)])
    assert lines[0] == "error: bad\\x1b[2J"
    assert len(lines) == 1 + MAX_DETAILS + 1 and lines[-1] == "  (+30 more)"


def test_config_values_are_not_echoed_at_length(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        yaml.safe_dump(
            {"base_model": "x", "learning_rate": "n" * 100_000, "chat_template": "t" * 50_000}
        )
    )
    result = CliRunner().invoke(cli, ["validate", str(cfg)])
    assert result.exit_code == 2
    _, details = check_lines(result.stderr)
    assert len(result.stderr) < 2000
    assert all(len(d) < 300 for d in details)


def test_a_yaml_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    lines = ["base_model: x", "a0: &a0 [" + ", ".join(["lol"] * 10) + "]"]
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    lines.append("datasets: [*a9]")  # 10**10 values once expanded
    (tmp_path / "bomb.yml").write_text("\n".join(lines) + "\n")
    (tmp_path / "loop.yml").write_text("base_model: x\ndatasets: &d [*d]\n")
    for name, words in (("bomb.yml", "expands to more than"), ("loop.yml", "refers to a value")):
        start = time.monotonic()
        result = CliRunner().invoke(cli, ["validate", str(tmp_path / name)])
        assert time.monotonic() - start < 1.0
        assert result.exit_code == 2
        head, _ = check_lines(result.stderr)
        assert words in head and len(result.stderr) < 400


def _one_error(result: Any, *words: str) -> str:
    assert result.exit_code == 1, result.output
    head, _ = check_lines(result.stderr)
    for w in words:
        assert w in head, (w, head)
    return head


def test_file_too_large_and_a_parent_that_is_a_file(deep: Path, tmp_path: Path) -> None:
    """RLIMIT_FSIZE (the merge ignores SIGXFSZ, so the write gets EFBIG) and an output path
    through a file: one line each, nothing left behind."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        result = merge(deep, "--output_path", str(tmp_path / "big"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    _one_error(result, f"{tmp_path / 'big'}: file too large")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file.txt").write_text("x")
    result = merge(deep, "--output_path", str(tmp_path / "file.txt" / "sub" / "out"))
    _one_error(result, "a part of the output path is a file, not a directory")


DRIVER = """
import io, json, os, subprocess, sys
from contextlib import redirect_stderr
from pathlib import Path
from shardforge.io.publish import atomic_directory
from shardforge.cli._common import run_guarded
full, ro = sys.argv[1:3]
# a 64 KiB file system and a read-only view of a folder, only in this mount namespace
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", full], check=True)
subprocess.run(["mount", "--bind", "-o", "ro", ro, ro], check=True)

def write(out):  # what the merge does: its output written into atomic_directory
    with atomic_directory(Path(out)) as tmp, open(tmp / "model.safetensors", "wb") as f:
        for _ in range(16):
            f.write(bytes(1 << 16))
            f.flush()

got = {}
for name, path in (("full", full), ("ro", ro)):
    err, code = io.StringIO(), 0
    with redirect_stderr(err):
        try:
            run_guarded(lambda: write(path + "/out"))
        except SystemExit as exc:
            code = exc.code
    got[name] = [code, err.getvalue(), sorted(os.listdir(path))]
print(json.dumps(got))
"""


def test_disk_full_and_read_only_file_system(tmp_path: Path) -> None:
    """A real ENOSPC while writing (a 64 KiB tmpfs) and EROFS (a read-only bind mount), in a
    private mount namespace (needs `unshare -m`; skipped where it is not permitted), through
    the publishing code the merge writes in and the CLI's error printer."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if shutil.which("unshare") is None or probe.returncode != 0:
        pytest.skip("unshare -m is not permitted here: no private mounts for ENOSPC/EROFS")
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    proc = subprocess.run(
        ["unshare", "-m", sys.executable, "-c", DRIVER, str(full), str(ro)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, words in (
        ("full", f"error: {full}: no space left on the device while writing the merged model"),
        ("ro", f"error: {ro / 'out'}: read-only file system"),
    ):
        code, stderr, left = got[name]
        assert code == 1 and left == [], (name, got[name])
        head, _ = check_lines(stderr)
        assert head.startswith(words), (name, head)
