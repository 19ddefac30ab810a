"""The structure rule a tool checks: src/ repeats itself in at most 8 pairs of places, as the
`duplicates` tool counts them with its default options (issue 35; it was 33 pairs, most of
them one multi-line `Field(None, description=...)` shape in the config mixins).

A pair is a place to look, not a verdict: where this fails, remove the repetition at its cause
(one helper, one table), not its look. The tool is a developer's tool (see the before-stop
hook); where it is not installed this test is skipped.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_PAIRS = 8


@pytest.mark.slow  # a child process, about 1 s
@pytest.mark.skipif(shutil.which("duplicates") is None, reason="the duplicates tool is absent")
def test_src_repeats_itself_in_at_most_8_pairs_of_places() -> None:
    run = subprocess.run(
        ["duplicates", "--most", "40", "--seconds", "60"],
        cwd=SRC,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "incomplete" not in run.stdout, run.stdout
    first = run.stdout.splitlines()[0]
    pairs = 0 if first.startswith("no duplicates") else int(first.split()[0])
    assert pairs <= MAX_PAIRS, run.stdout
