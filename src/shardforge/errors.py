"""User-facing errors. The CLI prints them as one `error:` line of at most `MAX_LINE` characters
(no traceback unless --debug), followed by at most `MAX_DETAILS` indented detail lines.

    raise MergeError("the checkpoint does not match the architecture", ["missing: lm_head.weight"])

`format_error` is the one formatter: it makes every character printable (names read from
checkpoint files may hold terminal escape sequences), shortens long paths in the middle (their
file name kept) and cuts what is still too long. `shown` is the way to echo a value read from a
file or a config in a message: a repr of at most `MAX_VALUE` characters, computed in bounded time.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Sequence

# the `error:` line, prefix included
MAX_LINE = 300
# indented lines after it; the rest is counted in "(+N more)"
MAX_DETAILS = 20
# characters of a value echoed in a message
MAX_VALUE = 200
# a detail line (these are lists of names; a long one is cut)
MAX_DETAIL_LINE = 300
INDENT = "  "
# a path is not shortened below this many characters
MIN_PATH = 32
ELLIPSIS = "..."

# an absolute path of at least two components, up to a quote, a space or punctuation
_PATH = re.compile(r"/[^\s'\"`()\[\]{},;:]+(?:/[^\s'\"`()\[\]{},;:]+)+")
_REPR = reprlib.Repr()
_REPR.maxstring = MAX_VALUE
_REPR.maxother = MAX_VALUE
_REPR.maxlevel = 3
for _attr in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset", "maxdeque", "maxarray"):
    setattr(_REPR, _attr, 8)


class ShardforgeError(ValueError):
    """Bad input from the user: a config, a path or a checkpoint. Printed without a traceback.

    `message` is the headline (one line), `details` the lines listed under it (missing keys,
    mismatches, problems); `str()` gives both, the details capped as the CLI prints them.
    """

    exit_code = 1

    def __init__(self, message: str = "", details: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.details = [str(d) for d in details]

    def __str__(self) -> str:
        return "\n".join([self.message, *(INDENT + d for d in cap_details(self.details))])

    def lines(self) -> list[str]:
        """The `error:` line and its indented details, as the CLI prints them."""
        return format_error(self.message, self.details)

    def __reduce__(self) -> tuple[object, ...]:
        # whole across processes (a rank's error), whatever the subclass's constructor
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(
    cls: type[ShardforgeError], args: tuple[object, ...], state: dict[str, object]
) -> ShardforgeError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class ConfigError(ShardforgeError):
    """The YAML config or a command-line override is invalid. Exit code 2."""

    exit_code = 2

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        if len(problems) == 1:
            super().__init__(f"{source}: {problems[0]}")
        else:
            super().__init__(f"{source}: {len(problems)} problems:", [f"- {p}" for p in problems])


class CheckpointError(ShardforgeError):
    """A checkpoint cannot be found, read or trusted."""


class MergeError(ShardforgeError):
    """The merge cannot proceed (architecture mismatch, output exists, no disk space, ...)."""


class ResumeRefused(MergeError):
    """--resume refused: what the interrupted merge left (its hidden directory, its journal)
    is kept, for a later --resume or a merge without it to remove."""


class StorageError(ShardforgeError):
    """Object storage refused or failed a request (credentials, bucket, endpoint, outage).
    `kind`: what the request's error was (`io.s3_adapter.kind`: "missing", "unreachable", ...;
    empty where no request failed)."""

    kind = ""


def printable(text: str) -> str:
    """`text` with every non-printable character (control characters, escape sequences,
    bidirectional overrides, newlines) written as a Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def shown(value: object, limit: int = MAX_VALUE) -> str:
    """A repr of `value` for a message: printable, at most about `limit` characters, and
    bounded in time whatever the value's size or nesting."""
    text = printable(_REPR.repr(value))
    return text if len(text) <= limit else text[: limit - len(ELLIPSIS)] + ELLIPSIS


def shorten_path(path: str, limit: int) -> str:
    """`/a/b/.../y/name`: the middle of a long path cut, its first folder and file name kept."""
    if len(path) <= limit:
        return path
    parts = path.split("/")
    head, tail = parts[:2], parts[-1:]
    for part in reversed(parts[2:-1]):
        if len("/".join([*head, ELLIPSIS, part, *tail])) > limit:
            break
        tail.insert(0, part)
    short = "/".join([*head, ELLIPSIS, *tail])
    if len(short) > limit:  # a very long file name: keep its end
        short = ELLIPSIS + path[-(limit - len(ELLIPSIS)) :]
    return short


def shorten(line: str, limit: int) -> str:
    """`line` within `limit` characters: long absolute paths shortened in the middle, in the
    order they appear (the first is usually the path the user gave; later ones are the news),
    each only as much as needed, then the middle of the line cut (its start and end kept)."""
    for path in dict.fromkeys(_PATH.findall(line)):
        excess = len(line) - limit
        if excess <= 0:
            break
        if len(path) > MIN_PATH:
            short = shorten_path(path, max(MIN_PATH, len(path) - excess))
            line = line.replace(path, short)
    if len(line) > limit:
        keep = limit - len(ELLIPSIS)
        line = line[: keep * 2 // 3] + ELLIPSIS + line[len(line) - (keep - keep * 2 // 3) :]
    return line


def cap_details(details: Sequence[str]) -> list[str]:
    """At most `MAX_DETAILS` lines, then "(+N more)"."""
    if len(details) <= MAX_DETAILS:
        return list(details)
    return [*details[:MAX_DETAILS], f"(+{len(details) - MAX_DETAILS} more)"]


def format_error(message: str, details: Sequence[str] = ()) -> list[str]:
    """`error: <headline>` (at most `MAX_LINE` characters) and the indented detail lines.
    Lines after the first of a multi-line `message` count as details."""
    head, *rest = message.splitlines() or [""]
    lines = [line.strip() for line in rest if line.strip()] + [
        line for d in details for line in (d.splitlines() or [""])
    ]
    out = [shorten("error: " + printable(head), MAX_LINE)]
    out += [
        INDENT + shorten(printable(d), MAX_DETAIL_LINE - len(INDENT)) for d in cap_details(lines)
    ]
    return out
