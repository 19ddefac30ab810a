"""`shardforge fetch examples|docs [--dest DIR]`: copy the example configs (with the tiny example's
model and data) or the docs out of the installed package (Axolotl's `fetch`, which downloads them
from GitHub: here nothing is downloaded).

Where they are: in a source checkout (an editable install) the folders beside `src/`; in an
installed wheel `<prefix>/share/shardforge/` (pyproject's `[tool.setuptools.data-files]`).
A file already at the destination is left as it is when it is the same, replaced when it
differs (as Axolotl's `fetch` updates it); a summary is printed.
"""

from __future__ import annotations

import filecmp
import shutil
import sys
import sysconfig
from pathlib import Path

import click

from shardforge.cli._common import fire_entry, shardforge_command
from shardforge.errors import ShardforgeError

WHAT = ("examples", "docs")
SHARE = Path("share") / "shardforge"

EPILOG = """\b
Examples:
  shardforge fetch examples                 # into ./examples
  shardforge fetch docs --dest ~/shardforge-docs
  python -m shardforge.cli.fetch examples --dest my-examples
"""


def shipped(what: str) -> Path:
    """The folder `what` (examples, docs) as shipped: the checkout's, else the installed one."""
    package = Path(__file__).resolve().parents[1]  # src/shardforge (or site-packages/shardforge)
    checkout = package.parents[1]
    places = [checkout / what] if (checkout / "pyproject.toml").is_file() else []
    places += [Path(sysconfig.get_paths()["data"]) / SHARE / what, Path(sys.prefix) / SHARE / what]
    for place in places:
        if place.is_dir():
            return place
    raise ShardforgeError(
        f"the shipped {what} were not found (looked in {', '.join(map(str, places))}); "
        "reinstall shardforge"
    )


def fetch(what: str, dest: Path) -> dict[str, list[str]]:
    """Copy the shipped folder `what` into `dest`: the files new, updated and unchanged."""
    source = shipped(what)
    if dest.exists() and not dest.is_dir():
        raise ShardforgeError(f"--dest {dest}: exists and is not a folder; choose another")
    if dest.resolve() == source.resolve():
        raise ShardforgeError(f"--dest {dest}: that is the shipped folder itself; choose another")
    done: dict[str, list[str]] = {"new": [], "updated": [], "unchanged": []}
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        name = file.relative_to(source)
        target = dest / name
        if target.is_file() and filecmp.cmp(file, target, shallow=False):
            done["unchanged"].append(str(name))
            continue
        done["updated" if target.exists() else "new"].append(str(name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target)
    return done


@shardforge_command(
    "fetch",
    epilog=EPILOG,
    params=[
        click.Argument(["what"], type=click.Choice(WHAT)),
        click.Option(
            ["--dest"],
            type=click.Path(file_okay=False),
            help="Destination folder (default ./WHAT).",
        ),
    ],
    overrides=False,
)
def command(what: str, dest: str | None) -> str:
    """Copy the shipped examples (configs, the tiny example's model and data) or docs into a
    folder: WHAT is examples or docs. Nothing is downloaded."""
    out = Path(dest) if dest else Path(what)
    done = fetch(what, out)
    lines = [f"{kind}: {name}" for kind in ("new", "updated") for name in done[kind]]
    counts = ", ".join(f"{len(v)} {k}" for k, v in done.items())
    return "".join(f"{line}\n" for line in lines) + f"{out}: {counts}\n"


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
