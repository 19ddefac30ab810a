"""The values the allow-list unpickler (`io.unpickler`) gives back, and its messages' helpers.

`Record` is an object of an allow-listed class as plain data (`record_class` makes one class of
it per allowed class of a profile); `ints`, `torch_size` and `ordered_dict` are what the
profiles put in place of torch's and the standard library's callables; `check_nesting` bounds
the result's depth; `Problem` / `refused` are the engine's refusals (the file named by
`unpickle`), with names from the pickle shown through `sanitize`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any, ClassVar

from shardforge.io.dtypes import DtypeName

MAX_NESTING = 100  # containers inside containers in the result (real pickles: under 20)
MAX_NAME = 80  # characters of a name from the pickle shown in a message


def sanitize(text: object, limit: int = MAX_NAME) -> str:
    """`text` as printable ASCII (anything else shown as ``?``), at most `limit` characters."""
    s = text if isinstance(text, str) else type(text).__name__
    s = s[: limit + 1]
    clean = "".join(c if " " <= c <= "~" else "?" for c in s)
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def size_text(n: int) -> str:
    """A byte count for a message: "1 GiB", "256 MiB", "12 bytes"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


class Problem(Exception):
    """The pickle broke a rule or is damaged; the message says how (the file is added)."""


def refused(what: str) -> Problem:
    return Problem(f"refused to load: the pickle {what} (the file may be malicious)")


class Record:
    """An object of an allow-listed class as plain data: the state the pickle gave it.

    The state lives in a dict of its own and is read as attributes (``rec.fqn``); class
    attributes and methods always win over it, names starting with ``__`` are never looked up
    there, and a missing one is an AttributeError (read optional ones with ``getattr``).
    """

    __slots__ = ("_state",)
    FIELDS: ClassVar[tuple[str, ...]] = ()  # names for a tuple state (TensorProperties)

    def __init__(self) -> None:
        self._state: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__"):
            try:
                return object.__getattribute__(self, "_state")[name]
            except (KeyError, AttributeError):
                pass
        raise AttributeError(name)

    def get(self, name: str, default: Any = None) -> Any:
        return self._state.get(name, default)

    def set_state(self, state: Any) -> None:
        """What BUILD does: merge a dict state, a (dict, slots) pair or a `FIELDS` tuple."""
        if isinstance(state, tuple) and self.FIELDS and len(state) == len(self.FIELDS):
            parts: tuple[Any, ...] = (dict(zip(self.FIELDS, state, strict=True)),)
        elif isinstance(state, tuple) and len(state) == 2:
            parts = state
        else:
            parts = (state,)
        for part in parts:
            if part is None:
                continue
            if not isinstance(part, dict):
                raise Problem(f"gives a {sanitize(part)} as the state of {type(self).__name__}")
            if not set(map(type, part)) <= {str}:
                raise Problem(f"gives {type(self).__name__} an attribute named by a non-string")
            self._state.update(part)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(sorted(self._state)[:8])})"


def record_class(
    name: str, module: str, doc: str = "", fields: tuple[str, ...] = ()
) -> type[Record]:
    """A `Record` subclass for one allow-listed class of a profile defined in `module`."""
    namespace = {"__slots__": (), "__doc__": doc, "__module__": module, "FIELDS": fields}
    return type(name, (Record,), namespace)


_LEAVES = frozenset({str, int, float, bool, bytes, type(None), DtypeName})


def _children(obj: Any) -> Iterable[Any] | None:
    if isinstance(obj, (list, tuple, set, frozenset)):
        return obj
    if isinstance(obj, dict):
        return obj.values()  # keys are scalars or records (checked when set)
    if isinstance(obj, Record):
        return obj._state.values()
    return None


def check_nesting(root: Any) -> None:
    """Refuse a result nested more than `MAX_NESTING` containers deep (iteratively: the
    pickle may share and even cycle its containers through the memo)."""
    top = _children(root)
    if top is None:
        return
    heights: dict[int, int] = {}  # container id -> containers below it, itself included
    path: list[tuple[Any, Iterable[Any], list[int]]] = [(root, iter(top), [0])]
    on_path = {id(root)}
    leaves = _LEAVES
    while path:
        obj, it, best = path[-1]
        for child in it:
            if type(child) in leaves:
                continue
            known = heights.get(id(child))
            if known is not None:
                if known > best[0]:
                    best[0] = known
                    if len(path) + known > MAX_NESTING:
                        raise refused(f"nests containers more than {MAX_NESTING} deep")
                continue
            kids = _children(child)
            if kids is None or id(child) in on_path:
                continue  # not a container; or a cycle, no deeper than the path already is
            if type(child) is tuple and set(map(type, child)) <= leaves:
                if best[0] < 1:  # a shape or offset: one level, nothing to walk
                    best[0] = 1
                continue
            if len(path) >= MAX_NESTING:
                raise refused(f"nests containers more than {MAX_NESTING} deep")
            on_path.add(id(child))
            path.append((child, iter(kids), [0]))
            break
        else:
            path.pop()
            on_path.discard(id(obj))
            heights[id(obj)] = height = best[0] + 1
            if path and height > path[-1][2][0]:
                path[-1][2][0] = height


def ints(value: Any, what: str) -> tuple[int, ...]:
    """`value` as a tuple of int64 values (a shape, offset or stride)."""
    if type(value) not in (tuple, list) or not set(map(type, value)) <= {int}:
        raise Problem(f"has a {what} that is not a tuple of integers (damaged)")
    if value and not (min(value) >= -(1 << 63) and max(value) < 1 << 63):
        raise Problem(f"has a {what} out of range (damaged)")
    return tuple(value)


def torch_size(value: Any = ()) -> tuple[int, ...]:
    """What ``torch.Size(value)`` becomes: a checked tuple of integers."""
    return ints(value, "torch.Size")


def ordered_dict(*args: Any) -> collections.OrderedDict[Any, Any]:
    """What ``collections.OrderedDict()`` becomes: an empty one, filled by SETITEMS."""
    if args:  # pickle fills it with SETITEMS; arguments would be hashed unchecked
        raise Problem("passes arguments to OrderedDict (damaged)")
    return collections.OrderedDict()
