"""`shardforge fetch examples|docs --dest DIR`: the shipped folders copied out (nothing
downloaded), an unchanged file left, a changed one replaced; every shipped file is listed in
pyproject's data-files, so that a wheel carries it."""

from __future__ import annotations

import glob
from pathlib import Path

import tomllib
from click.testing import CliRunner

from shardforge.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_fetch_examples_and_docs(tmp_path: Path) -> None:
    for what in ("examples", "docs"):
        dest = tmp_path / what
        result = CliRunner().invoke(cli, ["fetch", what, "--dest", str(dest)])
        assert result.exit_code == 0, result.output
        assert files(dest) == files(ROOT / what)
        assert (
            result.stdout.splitlines()[-1]
            == f"{dest}: {len(files(dest))} new, 0 updated, 0 unchanged"
        )
    (tmp_path / "examples" / "tiny-llama.yml").write_text("changed\n")
    again = CliRunner().invoke(cli, ["fetch", "examples", "--dest", str(tmp_path / "examples")])
    assert again.exit_code == 0, again.output
    assert again.stdout.splitlines()[0] == "updated: tiny-llama.yml"
    assert files(tmp_path / "examples") == files(ROOT / "examples")


def test_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = CliRunner().invoke(cli, ["fetch", "examples", "--dest", str(tmp_path / "file")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["fetch", "deepspeed_configs"])
    assert result.exit_code == 2 and "'deepspeed_configs' is not one of" in result.output


def test_every_shipped_file_is_in_the_wheel_data_files() -> None:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    listed = set()
    for target, patterns in table.items():
        assert target.startswith("share/shardforge/")
        for pattern in patterns:
            for found in glob.glob(str(ROOT / pattern)):
                path = Path(found)
                listed.add(path.relative_to(ROOT))
                assert target == "share/shardforge/" + str(path.parent.relative_to(ROOT))
    shipped = {
        p.relative_to(ROOT)
        for what in ("examples", "docs")
        for p in (ROOT / what).rglob("*")
        if p.is_file()
    }
    assert shipped == listed
