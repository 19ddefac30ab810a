"""The one allow-list unpickler: every pickle shardforge reads from a checkpoint goes through it.

Three kinds of pickle are read, each with its own `Profile` (allow-list and limits):

* `METADATA`: a DCP ``.metadata`` file. `load_metadata_pickle` gives plain `Record`s; with
  ``as_torch=True`` (torch's own reader: resume, ``--engine transformers``) those records are
  then converted to torch's dataclasses by calling their constructors with checked fields, so
  no torch object is ever built by the pickle itself.
* `TENSOR_RECORD`: the ``data.pkl`` of one ``torch.save`` record (a DCP chunk):
  `parse_tensor_record` describes the tensor without loading it.
* `RANK_STATE_DICT`: the ``data.pkl`` of a per-rank DTensor state dict (verl, LMMs-Engine):
  `load_rank_pickle` gives plain per-key records.

Rules, for every profile (the pure-Python `pickle._Unpickler` runs, so every opcode is ours):

* GLOBAL / STACK_GLOBAL / INST / OBJ resolve only allow-listed names, to objects defined here
  (records and functions; torch dtypes); nothing is imported.
* REDUCE / NEWOBJ / NEWOBJ_EX call only allow-listed callables, with a tuple of arguments.
* BUILD sets state only on this module's `Record`s (their state is kept in a dict of their
  own, never set as attributes on any class or object); on an ``OrderedDict`` it is ignored
  (a state dict's ``_metadata``); anything else is refused.
* APPEND(S) only to lists, SETITEM(S) only to dicts, ADDITEMS only to sets; dictionary and set
  keys are strings, bytes, bounded integers, None, booleans or records (hashing any other key
  could recurse without bound or be made slow).
* the memo is a dict of at most `Profile.max_memo` entries, indices below that; the input is
  at most `Profile.max_bytes`; a length field claiming more bytes than remain allocates
  nothing (the pickle is then cut off); integers are at most `MAX_INT_BYTES`; at most
  `MAX_MARKS` open marks and `MAX_STACK` items at one level; the result nests at most
  `MAX_NESTING` containers deep; extension codes and out-of-band buffers (BYTEARRAY8, which
  allocates its claimed size up front) are refused; persistent ids are checked by the profile.

Every refusal is a one-line `CheckpointError` naming the file; any name taken from the pickle
is shown sanitized (printable ASCII, at most `MAX_NAME` characters).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import math
import os
import pathlib
import pickle
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from shardforge.errors import CheckpointError
from shardforge.io.dtypes import STORAGE_CLASSES, DtypeName, is_dtype, lookup_dtype
from shardforge.io.files import open_regular

if TYPE_CHECKING:
    import torch

# limits shared by every profile
MAX_MARKS = 10_000  # open MARKs (nested tuples, lists, dicts under construction)
MAX_STACK = 10_000  # items on the stack at one level (pickle writes batches of 1,000)
MAX_NESTING = 100  # containers inside containers in the result (real pickles: under 20)
_CHECK_EVERY = 256  # opcodes between checks of the stack size
MAX_INT_BYTES = 256  # a LONG4 integer (a pickle's own integers take at most 9)
MAX_KEY_INT = 1 << 60  # dictionary keys: larger integers could be chosen to collide
MAX_NAME = 80  # characters of a name from the pickle shown in a message

# input limits per profile (the pickle's bytes, before anything is unpickled)
METADATA_MAX_BYTES = 1 << 30  # a .metadata holds ~200 bytes per chunk: 1 GiB is millions
TENSOR_RECORD_MAX_BYTES = 1 << 20  # one tensor's data.pkl is a few hundred bytes
RANK_STATE_DICT_MAX_BYTES = 256 << 20  # a rank file's state dict: ~400 bytes per tensor


_MISSING = object()


def sanitize(text: object, limit: int = MAX_NAME) -> str:
    """`text` as printable ASCII (anything else shown as ``?``), at most `limit` characters."""
    s = text if isinstance(text, str) else type(text).__name__
    s = s[: limit + 1]
    clean = "".join(c if " " <= c <= "~" else "?" for c in s)
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def _size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


class _Problem(Exception):
    """The pickle broke a rule or is damaged; the message says how (the file is added)."""


def _refused(what: str) -> _Problem:
    return _Problem(f"refused to load: the pickle {what} (the file may be malicious)")


# -- records -------------------------------------------------------------------------------------


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
                raise _Problem(f"gives a {sanitize(part)} as the state of {type(self).__name__}")
            for key, value in part.items():
                if not isinstance(key, str):
                    raise _Problem(
                        f"gives {type(self).__name__} an attribute named by a non-string"
                    )
                self._state[key] = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(sorted(self._state)[:8])})"


# DCP metadata, read as plain records (torch's classes of the same names; see `to_torch_metadata`)


class Metadata(Record):
    """`state_dict_metadata`, `planner_data`, `storage_data` (and `storage_meta`, `version`)."""

    __slots__ = ()


class TensorStorageMetadata(Record):
    """`properties`, `size`, `chunks`."""

    __slots__ = ()


class ChunkStorageMetadata(Record):
    """`offsets`, `sizes`."""

    __slots__ = ()


class BytesStorageMetadata(Record):
    """A non-tensor entry."""

    __slots__ = ()


class MetadataIndex(Record):
    """`fqn`, `offset`, `index`."""

    __slots__ = ()


class StorageMeta(Record):
    """Save ids (torch 2.4+)."""

    __slots__ = ()


class StorageInfo(Record):
    """`relative_path`, `offset`, `length` (and `transform_descriptors`, torch 2.7+)."""

    __slots__ = ()


class TensorProperties(Record):
    """`dtype`, `layout`, `requires_grad`, `memory_format` (an encoding), `pin_memory`."""

    __slots__ = ()
    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


# -- profiles ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """What one kind of pickle may hold, and how large it may be."""

    what: str  # for messages: "DCP .metadata files"
    globals: Mapping[tuple[str, str], Any]  # (module, name) -> the object the pickle gets
    max_bytes: int
    max_memo: int
    # a persistent id -> the object; None: persistent ids are refused
    persistent: Callable[[Any], Any] | None = None
    # a global not in `globals` -> an object, or None to refuse it (may raise its own _Problem)
    other_global: Callable[[str, str], Any] | None = None


class _Opaque:
    """A torch name a tensor record may hold but this parser does not model (`named`), or
    what calling it made. Calls give another `_Opaque`; BUILD is ignored on what calls made
    and refused on the name itself. The record is then read by torch's weights-only loader,
    after this parser has checked the whole pickle."""

    __slots__ = ("name", "named")

    def __init__(self, name: str, named: bool = False) -> None:
        self.name, self.named = name, named


_STR = frozenset({str})


def _key_ok(key: Any) -> bool:
    if isinstance(key, (str, bytes, Record)) or key is None:
        return True
    return type(key) in (int, bool) and -MAX_KEY_INT <= key <= MAX_KEY_INT


class SafeUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with every opcode that builds, calls or stores checked."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, profile: Profile) -> None:
        self._input = io.BytesIO(data)
        super().__init__(self._input, fix_imports=False)
        self.profile = profile
        self.memo: dict[int, Any] = {}
        self._callables = {id(v) for v in profile.globals.values() if callable(v)}

    # the main loop: as pickle's, with the stack limit checked every `_CHECK_EVERY` opcodes.
    # Reads come straight from the input: a length field claiming more than remains reads what
    # remains (nothing is allocated up front), and the pickle then ends without its STOP.
    def load(self) -> Any:
        s: Any = self
        read = s.read = self._input.read
        s.readline = self._input.readline
        s.metastack = []
        s.stack = []
        s.append = s.stack.append
        s.proto = 0
        dispatch = _BY_BYTE
        try:
            while True:
                for _ in range(_CHECK_EVERY):
                    dispatch[read(1)](self)
                if len(s.stack) > MAX_STACK:
                    raise _refused(f"pushes more than {MAX_STACK} items at one level")
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    # -- names and calls

    def find_class(self, module: str, name: str) -> Any:
        profile = self.profile
        if module == "torch":  # torch.float32, ...: in every profile
            dtype = lookup_dtype(name)
            if dtype is not None:
                return dtype
        target = profile.globals.get((module, name), _MISSING)
        if target is not _MISSING:
            return target
        if profile.other_global is not None:
            other = profile.other_global(module, name)
            if other is not None:
                return other
        raise _refused(
            f"references {sanitize(module)}.{sanitize(name)}, which is not on the allow-list "
            f"for {profile.what}"
        )

    def _check_callable(self, func: Any, verb: str) -> None:
        if id(func) not in self._callables:
            raise _refused(f"{verb} a {_describe(func)}, which is not on its allow-list")

    def _call(self, func: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(func, _Opaque):
            return _Opaque(func.name)
        self._check_callable(func, "calls")
        if type(args) is not tuple or type(kwargs) is not dict:
            raise _Problem("passes arguments that are not a tuple (damaged)")
        return func(*args, **kwargs)

    def _new(self, cls: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(cls, _Opaque):
            return _Opaque(cls.name)
        if not isinstance(cls, type):
            raise _refused(f"creates an object of a {_describe(cls)}")
        self._check_callable(cls, "creates an object of")
        if type(args) is not tuple or type(kwargs) is not dict:
            raise _Problem("passes arguments that are not a tuple (damaged)")
        if issubclass(cls, Record):
            if args or kwargs:
                raise _Problem(f"passes arguments to {cls.__name__} (damaged)")
            return cls()
        return cls.__new__(cls, *args, **kwargs)

    def load_reduce(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        args = stack.pop()
        stack[-1] = self._call(stack[-1], args, {})

    def load_newobj(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        args = stack.pop()
        stack[-1] = self._new(stack[-1], args, {})

    def load_newobj_ex(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        kwargs = stack.pop()
        args = stack.pop()
        stack[-1] = self._new(stack[-1], args, kwargs)

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ
        self.append(self._new(klass, tuple(args), {}))  # type: ignore[attr-defined]

    def persistent_load(self, pid: Any) -> Any:
        if self.profile.persistent is None:
            raise _refused(f"holds a persistent reference, which {self.profile.what} never do")
        return self.profile.persistent(pid)

    # -- state

    def load_build(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        state = stack.pop()
        inst = stack[-1]
        if isinstance(inst, Record):
            inst.set_state(state)
        elif (isinstance(inst, _Opaque) and not inst.named) or type(
            inst
        ) is collections.OrderedDict:
            pass  # nothing is set (a state dict's `_metadata`; what an unmodelled call made)
        else:
            raise _refused(f"sets the state of a {_describe(inst)}, which is not allowed")

    def load_append(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        value = stack.pop()
        _target(stack[-1], list, "appends to").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        _target(self.stack[-1], list, "appends to").extend(items)  # type: ignore[attr-defined]

    def load_setitem(self) -> None:
        stack = self.stack  # type: ignore[attr-defined]
        value = stack.pop()
        key = stack.pop()
        _target(stack[-1], dict, "sets an item of")[_key(key)] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        target = _target(self.stack[-1], dict, "sets an item of")  # type: ignore[attr-defined]
        if len(items) % 2:
            raise _Problem("has SETITEMS with an odd number of items (damaged)")
        keys = items[0::2]
        if not set(map(type, keys)) <= _STR:
            keys = [_key(k) for k in keys]
        target.update(zip(keys, items[1::2], strict=True))

    def load_dict(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        if len(items) % 2:
            raise _Problem("has DICT with an odd number of items (damaged)")
        self.append({_key(items[i]): items[i + 1] for i in range(0, len(items), 2)})  # type: ignore[attr-defined]

    def load_additems(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        _target(self.stack[-1], set, "adds to").update(_key(k) for k in items)  # type: ignore[attr-defined]

    def load_frozenset(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        self.append(frozenset(_key(k) for k in items))  # type: ignore[attr-defined]

    # -- memo, marks, sizes

    def _memo_put(self, index: int) -> None:
        limit = self.profile.max_memo
        if not 0 <= index < limit or (index not in self.memo and len(self.memo) >= limit):
            raise _refused(
                f"uses memo index {index}; {self.profile.what} use fewer than {limit} entries"
            )
        self.memo[index] = self.stack[-1]  # type: ignore[attr-defined]

    def load_put(self) -> None:
        line = self.readline()[:-1]  # type: ignore[attr-defined]
        if not line.isdigit() or len(line) > 20:
            raise _Problem("has a PUT with a bad index (damaged)")
        self._memo_put(int(line))

    def load_binput(self) -> None:
        self._memo_put(self.read(1)[0])  # type: ignore[attr-defined]

    def load_long_binput(self) -> None:
        self._memo_put(int.from_bytes(self.read(4), "little"))  # type: ignore[attr-defined]

    def load_memoize(self) -> None:
        memo = self.memo
        n = len(memo)
        if n >= self.profile.max_memo:
            self._memo_put(n)  # refuses
        memo[n] = self.stack[-1]  # type: ignore[attr-defined]

    def load_frame(self) -> None:
        self.read(8)  # type: ignore[attr-defined]  # a frame only groups opcodes: read on

    def load_mark(self) -> None:
        s: Any = self
        if len(s.metastack) >= MAX_MARKS:
            raise _refused(f"nests more than {MAX_MARKS} MARKs")
        s.metastack.append(s.stack)
        s.stack = []
        s.append = s.stack.append

    def load_long4(self) -> None:
        s: Any = self
        n = int.from_bytes(s.read(4), "little", signed=True)
        if not 0 <= n <= MAX_INT_BYTES:
            raise _refused(f"holds an integer of {n} bytes")
        s.append(pickle.decode_long(s.read(n)))

    def _forbidden(self) -> None:
        raise _refused("uses extension codes or out-of-band buffers")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.DICT[0]] = load_dict
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.FROZENSET[0]] = load_frozenset
    dispatch[pickle.PUT[0]] = load_put
    dispatch[pickle.BINPUT[0]] = load_binput
    dispatch[pickle.LONG_BINPUT[0]] = load_long_binput
    dispatch[pickle.MEMOIZE[0]] = load_memoize
    dispatch[pickle.MARK[0]] = load_mark
    dispatch[pickle.LONG4[0]] = load_long4
    dispatch[pickle.FRAME[0]] = load_frame
    for _op in (
        pickle.EXT1,
        pickle.EXT2,
        pickle.EXT4,
        pickle.BYTEARRAY8,
        pickle.NEXT_BUFFER,
        pickle.READONLY_BUFFER,
    ):
        dispatch[_op[0]] = _forbidden
    del _op


def _unknown(code: int) -> Callable[[Any], None]:
    def op(_: Any) -> None:
        raise _Problem(f"has an unknown opcode 0x{code:02x} (damaged)")

    return op


def _end(_: Any) -> None:
    raise _Problem("ends without a STOP opcode (truncated or damaged)")


# opcode byte (as read) -> its function; reading past the end gives b"" -> `_end`
_BY_BYTE: dict[bytes, Callable[[Any], None]] = {
    bytes([code]): SafeUnpickler.dispatch.get(code) or _unknown(code) for code in range(256)
}
_BY_BYTE[b""] = _end


def _describe(obj: Any) -> str:
    """What `obj` is, for a message: "function (torch.Size)", "dtype (torch.float32)", ..."""
    if isinstance(obj, _Opaque):
        return sanitize(obj.name)
    name = str(obj) if is_dtype(obj) else _GLOBAL_NAMES.get(id(obj))
    if isinstance(obj, type):
        kind = "class"
    elif callable(obj):
        kind = "function"
    else:
        kind = sanitize(type(obj).__name__)
    return f"{kind} ({name})" if name else kind


def _target(obj: Any, kind: type, verb: str) -> Any:
    if type(obj) is not kind and not (kind is dict and type(obj) is collections.OrderedDict):
        raise _refused(f"{verb} a {_describe(obj)}, which is not a {kind.__name__}")
    return obj


def _key(key: Any) -> Any:
    if not _key_ok(key):
        raise _refused(f"uses a {sanitize(key)} as a dictionary key")
    return key


_LEAVES = frozenset({str, int, float, bool, bytes, type(None), DtypeName})


def _children(obj: Any) -> Iterable[Any] | None:
    if isinstance(obj, (list, tuple, set, frozenset)):
        return obj
    if isinstance(obj, dict):
        return obj.values()  # keys are scalars or records (checked when set)
    if isinstance(obj, Record):
        return obj._state.values()
    return None


def _check_nesting(root: Any) -> None:
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
                        raise _refused(f"nests containers more than {MAX_NESTING} deep")
                continue
            kids = _children(child)
            if kids is None or id(child) in on_path:
                continue  # not a container; or a cycle, no deeper than the path already is
            if len(path) >= MAX_NESTING:
                raise _refused(f"nests containers more than {MAX_NESTING} deep")
            on_path.add(id(child))
            path.append((child, iter(kids), [0]))
            break
        else:
            path.pop()
            on_path.discard(id(obj))
            heights[id(obj)] = height = best[0] + 1
            if path and height > path[-1][2][0]:
                path[-1][2][0] = height


def unpickle(data: bytes, source: str, profile: Profile) -> Any:
    """`data` unpickled under `profile`; a one-line CheckpointError naming `source` otherwise."""
    if len(data) > profile.max_bytes:
        raise CheckpointError(
            f"{source}: refused to load: the pickle is {len(data)} bytes; {profile.what} are at "
            f"most {_size_text(profile.max_bytes)}"
        )
    try:
        obj = SafeUnpickler(data, profile).load()
        _check_nesting(obj)
        return obj
    except _Problem as exc:
        text = str(exc)
        prefix = "" if text.startswith("refused") else "the pickle "
        raise CheckpointError(f"{source}: {prefix}{text}") from None
    except RecursionError:
        raise CheckpointError(
            f"{source}: refused to load: the pickle nests too deeply (the file may be malicious)"
        ) from None
    except MemoryError:
        raise CheckpointError(
            f"{source}: refused to load: the pickle does not fit in memory"
        ) from None
    except Exception as exc:
        raise CheckpointError(
            f"{source}: not a readable pickle of {profile.what}; the file is damaged "
            f"({type(exc).__name__}: {sanitize(str(exc))})"
        ) from None


# -- DCP .metadata -------------------------------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.metadata"  # torch 2.2


def _value(*args: Any) -> Any:
    return args[0] if args else None


_INT = frozenset({int})


def _ints(value: Any, what: str) -> tuple[int, ...]:
    """`value` as a tuple of int64 values (a shape, offset or stride)."""
    if type(value) not in (tuple, list) or not set(map(type, value)) <= _INT:
        raise _Problem(f"has a {what} that is not a tuple of integers (damaged)")
    if value and not (min(value) >= -(1 << 63) and max(value) < 1 << 63):
        raise _Problem(f"has a {what} out of range (damaged)")
    return tuple(value)


def _size(value: Any = ()) -> tuple[int, ...]:
    return _ints(value, "torch.Size")


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise _Problem("has a path made of something other than strings (damaged)")
    return str(pathlib.PurePath(*parts))


def _ordered_dict(*args: Any) -> collections.OrderedDict[Any, Any]:
    if args:  # pickle fills it with SETITEMS; arguments would be hashed unchecked
        raise _Problem("passes arguments to OrderedDict (damaged)")
    return collections.OrderedDict()


METADATA = Profile(
    what="DCP .metadata files",
    globals={
        **{
            (_DCP_METADATA, cls.__name__): cls
            for cls in (
                Metadata,
                TensorStorageMetadata,
                ChunkStorageMetadata,
                BytesStorageMetadata,
                MetadataIndex,
                StorageMeta,
                TensorProperties,
            )
        },
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): _value,
        (_DCP_FILESYSTEM, "_StorageInfo"): StorageInfo,
        (_SHARDED_TENSOR, "TensorProperties"): TensorProperties,
        (_SHARDED_TENSOR, "MEM_FORMAT_ENCODING"): _value,
        ("torch", "Size"): _size,
        ("torch.serialization", "_get_layout"): _value,
        ("collections", "OrderedDict"): _ordered_dict,
        ("pathlib", "PosixPath"): _path,
        ("pathlib", "PurePosixPath"): _path,
        ("pathlib", "WindowsPath"): _path,
        ("pathlib", "PureWindowsPath"): _path,
    },
    max_bytes=METADATA_MAX_BYTES,
    max_memo=1 << 26,
)


VALUES = Profile(
    what="DCP non-tensor entries (optimizer settings and the like)",
    globals={("collections", "OrderedDict"): _ordered_dict},
    max_bytes=TENSOR_RECORD_MAX_BYTES,
    max_memo=1 << 16,
)
"""Plain values torch.save stores for a DCP state dict's non-tensor entries (numbers, strings,
tuples, lists, dicts): no class, no persistent id."""


def load_metadata_pickle(path: str | Path, as_torch: bool = False) -> Any:
    """Unpickle a DCP `.metadata` file through the allow-list; refuse anything else.

    By default the result is made of plain `Record`s (no torch class is instantiated, none of
    its code runs); ``as_torch=True`` converts them to torch's own classes, for torch's reader.
    """
    p = Path(path)
    fd = open_regular(p)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > METADATA_MAX_BYTES:
            raise CheckpointError(
                f"{p}: refused to load: it is {size} bytes; {METADATA.what} are at most "
                f"{_size_text(METADATA_MAX_BYTES)}"
            )
        try:
            data = f.read(size)
        except OSError as exc:
            raise CheckpointError(f"{p}: cannot read ({exc.strerror or exc})") from None
    raw = unpickle(data, str(p), METADATA)
    return to_torch_metadata(raw, str(p)) if as_torch else raw


@functools.cache
def _memory_formats() -> tuple[Any, ...]:
    import torch

    return (torch.contiguous_format, torch.channels_last, torch.preserve_format)


@functools.cache
def _layouts() -> dict[str, Any]:
    import torch

    return {f"torch.{n}": v for n in dir(torch) if isinstance(v := getattr(torch, n), torch.layout)}


def to_torch_metadata(raw: Any, source: str) -> Any:
    """torch's ``Metadata`` built from plain records: each of torch's dataclasses is made by
    its constructor from fields checked here (so the pickle sets nothing on any torch class)."""
    try:
        return _torch_metadata(raw)
    except _Problem as exc:
        raise CheckpointError(f"{source}: malformed DCP metadata: {exc}") from None
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(
            f"{source}: malformed DCP metadata ({type(exc).__name__}: {sanitize(str(exc))})"
        ) from None


def _opt(value: Any, kind: type, what: str) -> Any:
    if value is not None and not isinstance(value, kind):
        raise _Problem(f"{what} is a {sanitize(value)}, not a {kind.__name__}")
    return value


@functools.cache
def _init_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


def _fields(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `values` that `cls` (a dataclass) takes in this torch."""
    names = _init_names(cls)
    return {k: v for k, v in values.items() if k in names and v is not None}


def _plain_data(value: Any) -> Any:
    """Planner data: strings, numbers and containers of them (nesting is bounded already)."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif not (v is None or isinstance(v, (str, int, float, bool))):
            raise _Problem(f"planner data holds a {sanitize(v)}")
    return value


def _torch_properties(props: Any) -> Any:
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties as TorchProperties

    if not isinstance(props, TensorProperties):
        raise _Problem("a tensor entry has no TensorProperties")
    dtype = props.get("dtype")
    if not isinstance(dtype, torch.dtype):
        raise _Problem("a tensor entry has no dtype")
    layout = props.get("layout", "torch.strided")
    layout = _layouts().get(layout) if isinstance(layout, str) else None
    if layout is None:
        raise _Problem("a tensor entry has an unknown layout")
    fmt = props.get("memory_format", 0)
    if type(fmt) is not int or not 0 <= fmt < len(_memory_formats()):
        raise _Problem("a tensor entry has an unknown memory format")
    return TorchProperties(
        dtype=dtype,
        layout=layout,
        requires_grad=bool(props.get("requires_grad", False)),
        memory_format=_memory_formats()[fmt],
        pin_memory=bool(props.get("pin_memory", False)),
    )


def _torch_metadata(raw: Any) -> Any:
    import torch
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(raw, Metadata):
        raise _Problem(f"it holds a {sanitize(raw)}, not DCP Metadata")
    sd_meta = raw.get("state_dict_metadata")
    if not isinstance(sd_meta, dict):
        raise _Problem("no state_dict_metadata")
    entries: dict[str, Any] = {}
    for key, item in sd_meta.items():
        if not isinstance(key, str):
            raise _Problem("a state-dict key is not a string")
        if isinstance(item, BytesStorageMetadata):
            entries[key] = m.BytesStorageMetadata()
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise _Problem(f"entry {sanitize(key)!r} is a {sanitize(item)}")
        chunks = item.get("chunks")
        if not isinstance(chunks, list) or not all(
            isinstance(c, ChunkStorageMetadata) for c in chunks
        ):
            raise _Problem(f"entry {sanitize(key)!r} has no list of chunks")
        entries[key] = m.TensorStorageMetadata(
            properties=_torch_properties(item.get("properties")),
            size=torch.Size(_ints(item.get("size"), "size")),
            chunks=[
                m.ChunkStorageMetadata(
                    offsets=torch.Size(_ints(c.get("offsets"), "chunk offset")),
                    sizes=torch.Size(_ints(c.get("sizes"), "chunk size")),
                )
                for c in chunks
            ],
        )
    storage = raw.get("storage_data")
    torch_storage: dict[Any, Any] | None = None
    if storage is not None:
        if not isinstance(storage, dict):
            raise _Problem("storage_data is not a dict")
        torch_storage = {}
        for index, info in storage.items():
            if not isinstance(index, MetadataIndex) or not isinstance(info, StorageInfo):
                raise _Problem("storage_data holds something other than storage records")
            offset = index.get("offset")
            key = m.MetadataIndex(
                fqn=_opt(index.get("fqn"), str, "a storage key"),
                offset=None if offset is None else torch.Size(_ints(offset, "storage offset")),
                index=_opt(index.get("index"), int, "a storage index"),
            )
            transforms = info.get("transform_descriptors")
            if transforms is not None and not (
                isinstance(transforms, (list, tuple))
                and all(isinstance(t, str) for t in transforms)
            ):
                raise _Problem("transform descriptors are not strings")
            values = {
                "relative_path": _opt(info.get("relative_path"), str, "a relative path"),
                "offset": _ints((info.get("offset"),), "storage offset")[0],
                "length": _ints((info.get("length"),), "storage length")[0],
                "transform_descriptors": transforms,
            }
            torch_storage[key] = _StorageInfo(**_fields(_StorageInfo, values))
    fields: dict[str, Any] = {
        "state_dict_metadata": entries,
        "planner_data": _plain_data(raw.get("planner_data")),
        "storage_data": torch_storage,
        "version": _opt(raw.get("version"), str, "the version"),
    }
    meta = raw.get("storage_meta")
    if isinstance(meta, StorageMeta):
        modules = meta.get("modules") or []
        if not isinstance(modules, list) or not all(isinstance(x, str) for x in modules):
            raise _Problem("storage_meta.modules is not a list of strings")
        values = {
            "checkpoint_id": _opt(meta.get("checkpoint_id"), str, "the checkpoint id"),
            "save_id": _opt(meta.get("save_id"), str, "the save id"),
            "load_id": _opt(meta.get("load_id"), str, "the load id"),
            "modules": modules,
        }
        fields["storage_meta"] = m.StorageMeta(**_fields(m.StorageMeta, values))
    elif meta is not None:
        raise _Problem("storage_meta is not a StorageMeta")
    return m.Metadata(**_fields(m.Metadata, fields))


# -- storage references (torch.save records and rank files) --------------------------------------

_STORAGE_KEY = re.compile(r"^[A-Za-z0-9_]{1,64}$")


@dataclass(frozen=True)
class StorageRef:
    """A persistent reference to one storage record (``data/<key>`` in the zip)."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _StorageType:
    dtype: str  # its name (`lookup_dtype`)


_STORAGE_TYPES = {("torch", cls): _StorageType(row.name) for cls, row in STORAGE_CLASSES.items()}


def _storage_ref(pid: Any) -> Any:
    """``('storage', <storage type>, key, location, numel)``, as torch.save writes it."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise _refused("holds a persistent id that is not a storage reference")
    stype, key, numel = pid[1], pid[2], pid[4]
    if isinstance(stype, _Opaque):
        return stype
    if not isinstance(stype, _StorageType):
        raise _refused(f"names a {_describe(stype)} as a storage type")
    if not isinstance(key, str) or not _STORAGE_KEY.match(key):
        raise _Problem(f"has a malformed storage key {sanitize(key)!r}")
    if type(numel) is not int or numel < 0:
        raise _Problem(f"has a malformed size for storage {key!r}")
    return StorageRef(key, lookup_dtype(stype.dtype), numel)


# -- torch.save tensor records (DCP chunks) ------------------------------------------------------


class UnsupportedRecord(Exception):
    """The record is valid for torch but not a plain tensor this parser understands (the
    caller then falls back to ``torch.load(weights_only=True)``)."""


@dataclass(frozen=True)
class StoredTensor:
    """What a chunk record's data.pkl says about its tensor (nothing is loaded)."""

    storage_key: str
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _record_rebuild(storage: Any, storage_offset: Any, size: Any, stride: Any, *_: Any) -> Any:
    if isinstance(storage, _Opaque):
        return storage
    if not isinstance(storage, StorageRef):
        raise _Problem("has a tensor that does not reference a storage (damaged)")
    offset = _ints((storage_offset,), "storage offset")[0]
    return StoredTensor(
        storage.key,
        storage.dtype,
        storage.numel,
        offset,
        _ints(size, "size"),
        _ints(stride, "stride"),
    )


def _opaque_torch(module: str, name: str) -> Any:
    """Other torch names (rebuild functions of tensor kinds not modelled here) stand for
    themselves; anything outside torch is refused."""
    if module == "torch" or module.startswith("torch."):
        return _Opaque(f"{module}.{name}", named=True)
    return None


TENSOR_RECORD = Profile(
    what="torch.save tensor records",
    globals={
        ("torch._utils", "_rebuild_tensor_v2"): _record_rebuild,
        ("collections", "OrderedDict"): _ordered_dict,
        **_STORAGE_TYPES,
    },
    max_bytes=TENSOR_RECORD_MAX_BYTES,
    max_memo=1 << 12,
    persistent=_storage_ref,
    other_global=_opaque_torch,
)


def parse_tensor_record(data_pkl: bytes, source: str = "data.pkl") -> StoredTensor:
    """Describe the tensor pickled in a torch.save record's data.pkl without loading it.

    A hostile or damaged pickle is a CheckpointError; a valid one that is not a plain dense
    tensor of a legacy storage type raises `UnsupportedRecord` (the whole pickle has then been
    checked by this parser, and the caller may hand the record to torch's weights-only loader).
    """
    out = unpickle(data_pkl, source, TENSOR_RECORD)
    if not isinstance(out, StoredTensor):
        raise UnsupportedRecord(f"record holds {sanitize(out)}, not a plain tensor")
    return out


# -- per-rank DTensor state dicts ----------------------------------------------------------------


@dataclass(frozen=True)
class LocalTensor:
    """A plain tensor's description: which storage, and the view into it."""

    storage: StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """How a DTensor is laid out along one mesh dimension: Shard(dim) or Replicate()."""

    kind: str  # "shard" | "replicate"
    dim: int | None = None

    def __str__(self) -> str:
        return f"Shard({self.dim})" if self.kind == "shard" else "Replicate()"


@dataclass(frozen=True)
class DTensorRecord:
    """A DTensor as saved by one rank: global metadata plus its local tensor."""

    dtype: torch.dtype
    global_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh_shape: tuple[int, ...] | None
    coordinate: tuple[int, ...] | None
    local: LocalTensor


class _Spec(Record):
    __slots__ = ()


class _Mesh(Record):
    __slots__ = ()


class _Layout(Record):
    __slots__ = ()


class _Shard(Record):
    __slots__ = ()


class _Replicate(Record):
    __slots__ = ()


class _TensorMeta(NamedTuple):
    shape: Any
    stride: Any
    dtype: Any


class _ShardOrderEntry(NamedTuple):
    tensor_dim: Any
    mesh_dims: Any


class _DTensorClass:
    """Stands for ``torch.distributed.tensor.DTensor`` inside the pickle."""


_DTENSOR = _DTensorClass()


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *_: Any) -> Any:
    if not isinstance(storage, StorageRef):
        raise _Problem("has a tensor record that does not reference a storage")
    offset = _ints((storage_offset,), "storage offset")[0]
    return LocalTensor(storage, offset, _ints(size, "size"), _ints(stride, "stride"))


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


def _rebuild_wrapper_subclass(*_: Any) -> Any:
    raise _Problem("has a tensor subclass record outside _rebuild_from_type_v2")


def _torch_device(*args: Any) -> str:
    if not all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in args):
        raise _Problem("has a malformed torch.device")
    return ":".join(str(a) for a in args)


def _get_layout(name: Any) -> str:
    if name != "torch.strided":
        raise _Problem(
            f"has tensor layout {sanitize(name)!r}, which is not supported (only strided)"
        )
    return "torch.strided"


def _flat_prod(shape: Any) -> int:
    """The size of a (possibly nested) shape; nesting is bounded by `MAX_NESTING`."""
    if type(shape) is int:
        return shape
    if not isinstance(shape, tuple):
        raise _Problem("has a malformed mesh layout")
    return math.prod(_flat_prod(s) for s in shape)


def _placement(p: Any) -> Placement:
    if isinstance(p, _Shard):
        dim = p.get("dim")
        if type(dim) is not int:
            raise _Problem("has a Shard placement without a dimension")
        return Placement("shard", dim)
    if isinstance(p, _Replicate):
        return Placement("replicate")
    raise _Problem(f"has an unexpected placement {sanitize(p)}")


def _mesh_shape(mesh: _Mesh) -> tuple[int, ...] | None:
    layout = mesh.get("_layout")
    if isinstance(layout, _Layout):  # torch >= 2.9: _MeshLayout(axes=(_FlatLayout, ...))
        axes = layout.get("axes")
        if isinstance(axes, tuple) and all(isinstance(a, _Layout) for a in axes):
            return tuple(_flat_prod(a.get("shape", ())) for a in axes)
    old = mesh.get("mesh")  # older torch: the mesh tensor itself
    if isinstance(old, LocalTensor):
        return old.size
    return None


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> DTensorRecord:
    if func is not _rebuild_wrapper_subclass or new_type is not _DTENSOR:
        raise _Problem("has a tensor subclass other than DTensor")
    if not isinstance(args, tuple) or len(args) < 3:
        raise _Problem("has a DTensor record with unexpected arguments")
    dtype, size = args[1], args[2]
    if not is_dtype(dtype):
        raise _Problem("has a DTensor record without a dtype")
    attrs: dict[str, Any] = {}
    for part in state if isinstance(state, tuple) else (state,):
        if isinstance(part, dict):
            attrs.update(part)
    local, spec = attrs.get("_local_tensor"), attrs.get("_spec")
    if not isinstance(local, LocalTensor) or not isinstance(spec, _Spec):
        raise _Problem("has a DTensor record without its local tensor or spec")
    mesh = spec.get("mesh")
    if not isinstance(mesh, _Mesh):
        raise _Problem("has a DTensor spec without a device mesh")
    placements = spec.get("placements")
    if not isinstance(placements, tuple):
        raise _Problem("has a DTensor spec without placements")
    coordinate = mesh.get("_coordinate_on_dim")
    return DTensorRecord(
        dtype=dtype,
        global_shape=_ints(size, "DTensor size"),
        placements=tuple(_placement(p) for p in placements),
        mesh_shape=_mesh_shape(mesh),
        coordinate=None if coordinate is None else _ints(coordinate, "mesh coordinate"),
        local=local,
    )


_DT = "torch.distributed.tensor"
_SPEC_MODULES = (f"{_DT}._dtensor_spec", "torch.distributed._tensor.placement_types")
_PLACEMENT_MODULES = (f"{_DT}.placement_types", "torch.distributed._tensor.placement_types")

# globals that are legitimate in DTensor pickles but describe layouts this reader cannot merge
UNSUPPORTED_GLOBALS: dict[str, str] = {
    "_StridedShard": "strided sharding (FSDP2 combined with tensor parallelism)",
    "Partial": "a Partial (pending reduction) placement",
    "_NormPartial": "a Partial (pending reduction) placement",
}

# modules whose classes mean a known, legitimate layout this reader does not merge
UNSUPPORTED_MODULES: dict[str, str] = {
    "torch.distributed._shard": (
        "an FSDP1 ShardedTensor state dict (FSDP1 without a device mesh); save with FSDP2 or "
        "with a device mesh (DTensor) instead"
    ),
}


def _unsupported_rank_global(module: str, name: str) -> None:
    shown = f"{sanitize(module)}.{sanitize(name)}"
    if module.startswith("torch.distributed") and name in UNSUPPORTED_GLOBALS:
        raise _Problem(
            f"holds {UNSUPPORTED_GLOBALS[name]} ({shown}), which shardforge cannot merge; only "
            "Shard(dim) and Replicate() placements are supported"
        )
    for prefix, what in UNSUPPORTED_MODULES.items():
        if module == prefix or module.startswith(prefix + "."):
            raise _Problem(f"holds {what} ({shown}); shardforge cannot merge it")


# Old module paths (torch < 2.5 kept DTensor under torch.distributed._tensor) map onto the
# same records. As torch 2.13 writes it (checked with ``pickletools.dis``).
RANK_STATE_DICT = Profile(
    what="per-rank DTensor state dicts",
    globals={
        ("collections", "OrderedDict"): _ordered_dict,
        ("torch", "Size"): _size,
        ("torch", "device"): _torch_device,
        ("torch.serialization", "_get_layout"): _get_layout,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
        (_DT, "DTensor"): _DTENSOR,
        (f"{_DT}._api", "DTensor"): _DTENSOR,
        ("torch.distributed._tensor.api", "DTensor"): _DTENSOR,
        **{(m, "DTensorSpec"): _Spec for m in _SPEC_MODULES},
        **{(m, "TensorMeta"): _TensorMeta for m in _SPEC_MODULES},
        (f"{_DT}._dtensor_spec", "ShardOrderEntry"): _ShardOrderEntry,
        **{(m, "Shard"): _Shard for m in _PLACEMENT_MODULES},
        **{(m, "Replicate"): _Replicate for m in _PLACEMENT_MODULES},
        ("torch.distributed.device_mesh", "DeviceMesh"): _Mesh,
        ("torch.distributed._mesh_layout", "_MeshLayout"): _Layout,
        ("torch.distributed._mesh_layout", "_FlatLayout"): _Layout,
        **_STORAGE_TYPES,
    },
    max_bytes=RANK_STATE_DICT_MAX_BYTES,
    max_memo=1 << 24,
    persistent=_storage_ref,
    other_global=_unsupported_rank_global,
)


# our objects' ids -> the (first) global name they stand for, for messages
_GLOBAL_NAMES: dict[int, str] = {}
for _profile in (METADATA, TENSOR_RECORD, RANK_STATE_DICT):
    for (_module, _name), _target_object in _profile.globals.items():
        _GLOBAL_NAMES.setdefault(id(_target_object), f"{_module}.{_name}")
del _profile, _module, _name, _target_object


def load_rank_pickle(data: bytes, source: str) -> dict[str, LocalTensor | DTensorRecord]:
    """Parse a rank file's data.pkl into key -> record (plain tensors or DTensors)."""
    obj = unpickle(data, source, RANK_STATE_DICT)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{source}: holds a {sanitize(obj)}, not a state dict")
    out: dict[str, LocalTensor | DTensorRecord] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{source}: a state dict key is a {sanitize(key)}, not a string")
        if not isinstance(value, (LocalTensor, DTensorRecord)):
            raise CheckpointError(
                f"{source}: entry {sanitize(key)!r} holds {sanitize(value)}, not a tensor"
            )
        out[key] = value
    return out
