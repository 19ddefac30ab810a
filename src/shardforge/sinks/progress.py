"""The progress bar every sink (and the distributed merge) shows while it writes or verifies."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress(total: int, desc: str, quiet: bool) -> Iterator[Callable[[int], None]]:
    from tqdm import tqdm

    disable = quiet or not sys.stderr.isatty()
    with tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=disable
    ) as bar:
        yield bar.update
