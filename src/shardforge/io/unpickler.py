"""The one allow-list unpickler ENGINE: every pickle shardforge reads goes through it.

It knows no checkpoint format: each format brings its own `Profile` (which globals a pickle may
name and what they become, how its persistent ids are read, its size limits), e.g.
`formats.dcp.pickles`, `formats.rankfiles.pickles`, `formats.lightning_meta`. The pure-Python
`pickle._Unpickler` runs, with every opcode that names, calls, builds or stores checked: only
the profile's globals (and torch dtypes) resolve, and nothing is imported; only its callables
are called, with a tuple of arguments; BUILD sets state only on `Record`s (in a dict of their
own, never as attributes of a class) and is ignored on an ``OrderedDict`` (a state dict's
``_metadata``); items go only into lists, dicts and sets, keyed by strings, bytes, bounded
integers, None, booleans or records (hashing anything else could recurse or be made slow).
The input, memo, integers, open marks, items at one level and the result's nesting are bounded
(the limits below and in `Profile`); a length field claiming more bytes than remain allocates
nothing; extension codes and out-of-band buffers (BYTEARRAY8 allocates up front) are refused.
Memory is bounded by the input's size, not only by the caps: the memo is a list (8 bytes an
entry) of at most one entry per `BYTES_PER_MEMO` bytes of the pickle (and at most the profile's
`max_memo`), and the containers, records and scalars it builds are charged as they are made
(their approximate size in memory) against `MEMORY_PER_BYTE` times its size (and at most `MAX_MEMORY`);
either refused the moment it is exceeded, naming the cause. Time is bounded by the size cap:
each byte is at most one opcode.
Every refusal is a one-line `CheckpointError` naming the file, names from the pickle sanitized.
"""

from __future__ import annotations

import collections
import gc
import io
import pickle
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardforge.errors import CheckpointError
from shardforge.io.dtypes import is_dtype, lookup_dtype
from shardforge.io.pickle_data import (
    MAX_NESTING,
    Problem,
    Record,
    check_nesting,
    ints,
    ordered_dict,
    record_class,
    refused,
    sanitize,
    size_text,
    torch_size,
)

__all__ = [  # the engine, and the values and helpers of `io.pickle_data` the formats use
    "MAX_NESTING",
    "Opaque",
    "Problem",
    "Profile",
    "Record",
    "SafeUnpickler",
    "describe",
    "ints",
    "ordered_dict",
    "record_class",
    "refused",
    "sanitize",
    "size_text",
    "torch_size",
    "unpickle",
]

# limits shared by every profile
MAX_MARKS = 10_000  # open MARKs (nested tuples, lists, dicts under construction)
MAX_STACK = 10_000  # items on the stack at one level (pickle writes batches of 1,000)
_CHECK_EVERY = 256  # opcodes between checks of the stack size
MAX_INT_BYTES = 256  # a LONG4 integer (a pickle's own integers take at most 9)
MAX_KEY_INT = 1 << 60  # dictionary keys: larger integers could be chosen to collide
# memory bounded by the input: real pickles memoize about one object per 10 bytes (a DCP
# .metadata 9.6, torch.save's state dicts 10 to 16) and build about 13 bytes of containers and
# records per byte (a DCP .metadata, as `_COST` estimates them); a hostile one can memoize one
# per 2 bytes and build over 100 bytes per byte (an empty set per 2 bytes). Besides the per-byte
# bounds, each has a bound of its own whatever the file's size (the memo: `Profile.max_memo`)
BYTES_PER_MEMO = 4  # the memo holds at most one entry per this many bytes of the pickle
MEMORY_PER_BYTE = 20  # containers built: at most this many bytes per byte of the pickle
MAX_MEMORY = 512 << 20  # and at most this many bytes, however large the pickle
MIN_MEMO = 1 << 12  # entries every pickle may memoize, however small
MIN_MEMORY = 1 << 20  # bytes of containers every pickle may build, however small
# approximate bytes a container costs (CPython 3.11, 64-bit, its garbage collector's header
# included), and each item put in it
_COST = {"list": 72, "dict": 80, "set": 232, "tuple": 56, "record": 128}
_ITEM = {"list": 8, "dict": 48, "set": 32, "tuple": 8}
_GAP = object()  # a memo slot the pickle skipped


# our objects' ids -> (the object, the first global name it stands for), for messages
_GLOBAL_NAMES: dict[int, tuple[Any, str]] = {}


@dataclass(frozen=True)
class Profile:
    """What one kind of pickle may hold, and how large it may be."""

    what: str  # for messages: "DCP .metadata files"
    globals: Mapping[tuple[str, str], Any]  # (module, name) -> the object the pickle gets
    max_bytes: int
    max_memo: int
    # a persistent id -> the object; None: persistent ids are refused
    persistent: Callable[[Any], Any] | None = None
    # a global not in `globals` -> an object, or None to refuse it (may raise its own Problem)
    other_global: Callable[[str, str], Any] | None = None

    def __post_init__(self) -> None:
        for (module, name), target in self.globals.items():
            _GLOBAL_NAMES.setdefault(id(target), (target, f"{module}.{name}"))


class Opaque:
    """A torch name a profile lets a pickle hold but does not model (`named`), or what calling
    it made. Calls give another `Opaque`; BUILD is ignored on what calls made and refused on
    the name itself (a tensor record then goes to torch's weights-only loader, after this
    parser has checked the whole pickle)."""

    __slots__ = ("name", "named")

    def __init__(self, name: str, named: bool = False) -> None:
        self.name, self.named = name, named


def describe(obj: Any) -> str:
    """What `obj` is, for a message: "function (torch.Size)", "dtype (torch.float32)", ..."""
    if isinstance(obj, Opaque):
        return sanitize(obj.name)
    known = _GLOBAL_NAMES.get(id(obj))
    name = str(obj) if is_dtype(obj) else known[1] if known and known[0] is obj else None
    if isinstance(obj, type):
        kind = "class"
    elif callable(obj):
        kind = "function"
    else:
        kind = sanitize(type(obj).__name__)
    return f"{kind} ({name})" if name else kind


def _target(obj: Any, kind: type, verb: str) -> Any:
    if type(obj) is not kind and not (kind is dict and type(obj) is collections.OrderedDict):
        raise refused(f"{verb} a {describe(obj)}, which is not a {kind.__name__}")
    return obj


def _key(key: Any) -> Any:
    """`key` if it may key a dictionary or set: hashing it is bounded and cannot be steered."""
    if isinstance(key, (str, bytes, Record)) or key is None:
        return key
    if not (type(key) in (int, bool) and -MAX_KEY_INT <= key <= MAX_KEY_INT):
        raise refused(f"uses a {sanitize(key)} as a dictionary key")
    return key


# -- the unpickler -------------------------------------------------------------------------------


class SafeUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with every opcode that builds, calls or stores checked."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    # pickle._Unpickler's own working state (set by `load`, used by its opcode functions)
    stack: list[Any]
    metastack: list[list[Any]]
    append: Callable[[Any], None]
    read: Callable[[int], bytes]
    readline: Callable[[], bytes]
    pop_mark: Callable[[], list[Any]]
    proto: int

    def __init__(self, data: bytes, profile: Profile) -> None:
        self._input = io.BytesIO(data)
        super().__init__(self._input, fix_imports=False)
        self.profile = profile
        self.memo: list[Any] = []
        self._size = len(data)
        self._memo_limit = min(profile.max_memo, max(MIN_MEMO, len(data) // BYTES_PER_MEMO))
        self._budget = max(MIN_MEMORY, min(MAX_MEMORY, len(data) * MEMORY_PER_BYTE))
        self._spent = 0  # estimated bytes of the containers built so far
        self._callables = {id(v) for v in profile.globals.values() if callable(v)}

    def _spend(self, n: int) -> None:
        """Charge `n` bytes of built containers; refused beyond the budget. (The opcodes a
        real pickle runs most charge inline: ``self._spent += n`` then this with 0.)"""
        self._spent += n
        if self._spent > self._budget:
            raise refused(
                f"builds more than {size_text(self._budget)} of objects from {self._size} bytes "
                f"(at most {MEMORY_PER_BYTE} bytes per byte of the file, and "
                f"{size_text(MAX_MEMORY)} in all)"
            )

    # the main loop: as pickle's, with the stack limit checked every `_CHECK_EVERY` opcodes.
    # Reads come straight from the input: a length field claiming more than remains reads what
    # remains (nothing is allocated up front), and the pickle then ends without its STOP.
    def load(self) -> Any:
        read = self.read = self._input.read
        self.readline = self._input.readline
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        dispatch = _BY_BYTE
        try:
            while True:
                for _ in range(_CHECK_EVERY):
                    dispatch[read(1)](self)
                if len(self.stack) > MAX_STACK:
                    raise refused(f"pushes more than {MAX_STACK} items at one level")
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def find_class(self, module: str, name: str) -> Any:
        profile = self.profile
        if module == "torch" and (dtype := lookup_dtype(name)) is not None:
            return dtype  # torch.float32, ...: in every profile
        target = profile.globals.get((module, name))
        if target is None and profile.other_global is not None:
            target = profile.other_global(module, name)
        if target is not None:
            return target
        raise refused(
            f"references {sanitize(module)}.{sanitize(name)}, which is not on the allow-list "
            f"for {profile.what}"
        )

    def _check_call(self, func: Any, verb: str, args: Any, kwargs: Any) -> None:
        if id(func) not in self._callables:
            raise refused(f"{verb} a {describe(func)}, which is not on its allow-list")
        if type(args) is not tuple or type(kwargs) is not dict:
            raise Problem("passes arguments that are not a tuple (damaged)")

    def _call(self, func: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(func, Opaque):
            return Opaque(func.name)
        self._check_call(func, "calls", args, kwargs)
        return func(*args, **kwargs)

    def _new(self, cls: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(cls, Opaque):
            return Opaque(cls.name)
        if not isinstance(cls, type):
            raise refused(f"creates an object of a {describe(cls)}")
        self._check_call(cls, "creates an object of", args, kwargs)
        if issubclass(cls, Record):
            if args or kwargs:
                raise Problem(f"passes arguments to {cls.__name__} (damaged)")
            self._spend(_COST["record"])
            return cls()
        return cls.__new__(cls, *args, **kwargs)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args, {})

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, {})

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, kwargs)

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ
        self.append(self._new(klass, tuple(args), {}))

    def persistent_load(self, pid: Any) -> Any:
        if self.profile.persistent is None:
            raise refused(f"holds a persistent reference, which {self.profile.what} never do")
        return self.profile.persistent(pid)

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, Record):
            self._spend(_ITEM["dict"] * (len(state) if isinstance(state, (dict, tuple)) else 1))
            inst.set_state(state)
        elif not (
            (isinstance(inst, Opaque) and not inst.named) or type(inst) is collections.OrderedDict
        ):  # else nothing is set (a state dict's `_metadata`; what an unmodelled call made)
            raise refused(f"sets the state of a {describe(inst)}, which is not allowed")

    def load_append(self) -> None:
        value = self.stack.pop()
        self._spend(_ITEM["list"])
        _target(self.stack[-1], list, "appends to").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._spend(_ITEM["list"] * len(items))
        _target(self.stack[-1], list, "appends to").extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._spend(_ITEM["dict"])
        _target(self.stack[-1], dict, "sets an item of")[_key(key)] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = _target(self.stack[-1], dict, "sets an item of")
        if len(items) % 2:
            raise Problem("has SETITEMS with an odd number of items (damaged)")
        self._spend(_ITEM["dict"] * (len(items) // 2))
        keys = items[0::2]
        if not set(map(type, keys)) <= {str}:
            keys = [_key(k) for k in keys]
        target.update(zip(keys, items[1::2], strict=True))

    def load_dict(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise Problem("has DICT with an odd number of items (damaged)")
        self._spend(_COST["dict"] + _ITEM["dict"] * (len(items) // 2))
        self.append({_key(items[i]): items[i + 1] for i in range(0, len(items), 2)})

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._spend(_ITEM["set"] * len(items))
        _target(self.stack[-1], set, "adds to").update(_key(k) for k in items)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        self._spend(_COST["set"] + _ITEM["set"] * len(items))
        self.append(frozenset(_key(k) for k in items))

    def _memo_put(self, index: int) -> None:
        limit, memo = self.profile.max_memo, self.memo
        if not 0 <= index < limit:
            raise refused(
                f"uses memo index {index}; {self.profile.what} use fewer than {limit} entries"
            )
        if index >= self._memo_limit:
            raise refused(
                f"has a memo that exceeds {self._memo_limit} entries for a file of {self._size} "
                f"bytes (at most one per {BYTES_PER_MEMO} bytes)"
            )
        if index == len(memo):  # MEMOIZE, and puts in order
            memo.append(self.stack[-1])
            return
        if index > len(memo):
            memo.extend([_GAP] * (index - len(memo) + 1))
        memo[index] = self.stack[-1]

    def load_put(self) -> None:
        line = self.readline()[:-1]
        if not line.isdigit() or len(line) > 20:
            raise Problem("has a PUT with a bad index (damaged)")
        self._memo_put(int(line))

    def load_binput(self) -> None:
        self._memo_put(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._memo_put(int.from_bytes(self.read(4), "little"))

    def load_memoize(self) -> None:  # what protocol 4 writes for every object it memoizes
        memo = self.memo
        if len(memo) < self._memo_limit:
            memo.append(self.stack[-1])
        else:
            self._memo_put(len(memo))

    def _memo_get(self, index: int) -> None:
        value = self.memo[index] if 0 <= index < len(self.memo) else _GAP
        if value is _GAP:
            raise Problem(f"reads memo entry {index}, which it never stored (damaged)")
        self.append(value)

    def load_get(self) -> None:
        self._memo_get(int(self.readline()[:-1]))  # not a number: damaged, as in pickle

    def load_binget(self) -> None:
        self._memo_get(self.read(1)[0])

    def load_long_binget(self) -> None:  # inline `_memo_get`: a real .metadata's most common
        index = int.from_bytes(self.read(4), "little")
        memo = self.memo
        value = memo[index] if index < len(memo) else _GAP
        if value is _GAP:
            raise Problem(f"reads memo entry {index}, which it never stored (damaged)")
        self.append(value)

    # containers: charged as they are made (`_COST`), and for each item put in them (`_ITEM`)
    def load_empty_list(self) -> None:
        self._spend(_COST["list"])
        self.append([])

    def load_empty_dict(self) -> None:
        self._spend(_COST["dict"])
        self.append({})

    def load_empty_set(self) -> None:
        self._spend(_COST["set"])
        self.append(set())

    def load_list(self) -> None:
        items = self.pop_mark()
        self._spend(_COST["list"] + _ITEM["list"] * len(items))
        self.append(items)

    def load_tuple(self) -> None:
        items = self.pop_mark()
        self._spend(_COST["tuple"] + _ITEM["tuple"] * len(items))
        self.append(tuple(items))

    def load_tuple1(self) -> None:
        self._spend(_COST["tuple"] + _ITEM["tuple"])
        self.stack[-1] = (self.stack[-1],)

    def load_tuple2(self) -> None:
        self._spend(_COST["tuple"] + 2 * _ITEM["tuple"])
        self.stack[-2:] = [(self.stack[-2], self.stack[-1])]

    def load_tuple3(self) -> None:
        self._spend(_COST["tuple"] + 3 * _ITEM["tuple"])
        self.stack[-3:] = [(self.stack[-3], self.stack[-2], self.stack[-1])]

    def load_frame(self) -> None:
        self.read(8)  # a frame only groups opcodes: read on

    def load_mark(self) -> None:
        if len(self.metastack) >= MAX_MARKS:
            raise refused(f"nests more than {MAX_MARKS} MARKs")
        self.metastack.append(self.stack)
        self.stack = []
        self.append = self.stack.append

    def load_long4(self) -> None:
        n = int.from_bytes(self.read(4), "little", signed=True)
        if not 0 <= n <= MAX_INT_BYTES:
            raise refused(f"holds an integer of {n} bytes")
        self.append(pickle.decode_long(self.read(n)))

    def _forbidden(self) -> None:
        raise refused("uses extension codes or out-of-band buffers")

    # every load_<opcode> above replaces pickle's own
    for _name, _func in list(locals().items()):
        if _name.startswith("load_"):
            dispatch[getattr(pickle, _name[5:].upper())[0]] = _func
    for _name in ("EXT1", "EXT2", "EXT4", "BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER"):
        dispatch[getattr(pickle, _name)[0]] = _forbidden
    del _name, _func


def _charged(load: Callable[[Any], None]) -> Callable[[Any], None]:
    def op(self: SafeUnpickler) -> None:
        load(self)
        self._spend(sys.getsizeof(self.stack[-1]))

    return op


# the scalars a pickle makes from its bytes (strings, bytes, numbers) are charged too: each is
# an object of its own (a string of 2 characters from 4 bytes of the file takes 51)
for _name in (
    "INT", "BININT", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING",
    "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "SHORT_BINBYTES", "BINBYTES", "BINBYTES8",
):  # fmt: skip
    _code = getattr(pickle, _name)[0]
    SafeUnpickler.dispatch[_code] = _charged(SafeUnpickler.dispatch[_code])
del _name, _code


def _unknown(code: int) -> Callable[[Any], None]:
    def op(_: Any) -> None:
        raise Problem(f"has an unknown opcode 0x{code:02x} (damaged)")

    return op


def _end(_: Any) -> None:
    raise Problem("ends without a STOP opcode (truncated or damaged)")


# opcode byte (as read) -> its function; reading past the end gives b"" -> `_end`
_BY_BYTE: dict[bytes, Callable[[Any], None]] = {
    bytes([code]): SafeUnpickler.dispatch.get(code) or _unknown(code) for code in range(256)
}
_BY_BYTE[b""] = _end


def unpickle(data: bytes, source: str, profile: Profile) -> Any:
    """`data` unpickled under `profile`; a one-line CheckpointError naming `source` otherwise."""
    if len(data) > profile.max_bytes:
        raise CheckpointError(
            f"{source}: refused to load: the pickle is {len(data)} bytes; {profile.what} are at "
            f"most {size_text(profile.max_bytes)}"
        )
    # no garbage collection while the pickle builds (it makes no cycle the collector could
    # free): each pass walks every container built so far, which made the time quadratic in
    # their number (a memo-fill of 90 MB took minutes)
    collecting = gc.isenabled()
    gc.disable()
    try:
        obj = SafeUnpickler(data, profile).load()
        check_nesting(obj)
        return obj
    except Problem as exc:
        text = str(exc)
        prefix = "" if text.startswith("refused") else "the pickle "
        raise CheckpointError(f"{source}: {prefix}{text}") from None
    except RecursionError:
        raise CheckpointError(f"{source}: {refused('nests too deeply')}") from None
    except MemoryError:
        text = "refused to load: the pickle does not fit in memory"
        raise CheckpointError(f"{source}: {text}") from None
    except Exception as exc:
        raise CheckpointError(
            f"{source}: not a readable pickle of {profile.what}; the file is damaged "
            f"({type(exc).__name__}: {sanitize(str(exc))})"
        ) from None
    finally:
        if collecting:
            gc.enable()
