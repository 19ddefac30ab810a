from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from shardforge import __version__
from shardforge.cli.main import COMMANDS, SUMMARIES, cli

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output
    assert set(SUMMARIES) == set(COMMANDS)
    assert "Examples:" in result.output


def test_every_command_has_help_with_examples() -> None:
    for name in COMMANDS:
        result = CliRunner().invoke(cli, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert "Examples:" in result.output, name


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_unknown_command() -> None:
    result = CliRunner().invoke(cli, ["trian"])
    assert result.exit_code == 2
    assert "No such command 'trian'" in result.output


def _console_script() -> str:
    found = shutil.which("shardforge", path=str(Path(sys.executable).parent))
    assert found, "the console script is installed beside the interpreter"
    return found


def test_installed_console_script_runs_in_a_subprocess() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    ok = subprocess.run(
        [_console_script(), "validate", "examples/tiny-llama.yml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "base_model: examples/tiny-llama/base" in ok.stdout


def test_typo_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "typo.yml"
    cfg.write_text("base_model: m\nlearnig_rate: 1e-4\n")
    bad = subprocess.run(
        [_console_script(), "validate", str(cfg)], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        f"error: {cfg}: learnig_rate: unknown key; did you mean 'learning_rate'?"
    ]
    assert "Traceback" not in bad.stderr


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "typo.yml"
    cfg.write_text("base_model: m\nlearnig_rate: 1e-4\n")
    bad = subprocess.run(
        [_console_script(), "validate", str(cfg), "--debug"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode != 0
    assert "Traceback" in bad.stderr
    assert "ConfigError" in bad.stderr


def test_python_dash_m_shardforge() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardforge", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert __version__ in out.stdout


EXIT_SCRIPT = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from shardforge.cli.main import exit_now

class Noisy:  # a module teardown would finalize it
    def __del__(self):
        print("torn down", file=sys.stderr)

keep = Noisy()
atexit.register(lambda: print("exit handler ran", file=sys.stderr))
sys.stdout.write("buffered, no newline")
if sys.argv[1] == "thread":  # a non-daemon thread still working: a normal exit waits for it
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
if sys.argv[1] == "pool":  # an idle pool (non-daemon workers) left open, as the cast pool is
    ThreadPoolExecutor(2).submit(print, "pool ran").result()
exit_now(int(sys.argv[2]))
"""


def test_exit_now_flushes_runs_exit_handlers_and_keeps_the_status() -> None:
    for mode, code in (("plain", 0), ("plain", 3), ("thread", 0), ("pool", 0)):
        out = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT, mode, str(code)],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert out.returncode == code, (mode, out.stderr)
        assert out.stdout.startswith("buffered, no newline"), mode
        assert "exit handler ran" in out.stderr, mode
        assert "torn down" not in out.stderr, mode  # the modules were not torn down
        assert ("thread done" in out.stdout) == (mode == "thread")


def test_console_entry_point_reports_errors_with_their_status(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardforge", "validate", str(tmp_path / "missing.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode != 0
    assert out.stderr.startswith("error:"), out.stderr
    assert "missing.yml" in out.stderr


# Axolotl's commands (its src/axolotl/cli/main.py, with lm-eval its built-in plugin command)
AXOLOTL_COMMANDS = (
    "preprocess", "train", "evaluate", "inference", "merge-sharded-fsdp-weights", "merge-lora",
    "fetch", "vllm-serve", "quantize", "delinearize-llama4", "generate-cli-config-options",
    "agent-docs", "config-schema", "lm-eval",
)  # fmt: skip


def test_readme_maps_every_axolotl_command_and_lists_every_command() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Coming from Axolotl")
    table = [
        line.split(" | ")
        for line in readme[start : readme.index("\n## ", start + 1)].splitlines()
        if line.startswith("| `axolotl ")
    ]
    rows = {cells[0].lstrip("| `").split()[1].rstrip("`"): cells for cells in table}
    assert set(AXOLOTL_COMMANDS) <= set(rows), set(AXOLOTL_COMMANDS) - set(rows)
    for name, cells in rows.items():
        twin = cells[1].strip()
        if twin == "none":
            assert len(cells[2]) > 20, f"{name}: say why there is no twin"
        elif not name.startswith("COMMAND"):
            assert twin.startswith("`shardforge "), name
            assert twin.split()[1].rstrip("`") in COMMANDS, name
    commands = readme[readme.index("## Commands") :]
    for name in COMMANDS:
        assert f"`shardforge {name}" in commands or f"shardforge {name}" in readme, name
