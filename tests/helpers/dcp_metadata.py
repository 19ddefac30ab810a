"""DCP `.metadata` files of any size, shaped as `dcp.save` writes them, without saving a tensor.

`fsdp_metadata` builds torch's own `Metadata` (its dataclasses, as the default save planner
fills them) for a Llama-shaped model whose every tensor, and each of its optimizer states, is
sharded along dim 0 over `ranks` ranks (FSDP2), and `metadata_bytes` pickles it the way
``FileSystemWriter.finish`` does (``pickle.dump``, default protocol). The bytes are a real
file's: only the tensors behind them do not exist. `metadata_of_size` grows the model until the
file reaches a size (about 1 MB a second). Used by the unpickler's tests and `benchmarks/metadata_bound.py`.
"""

from __future__ import annotations

import pickle
from typing import Any

# one decoder layer of a Llama-shaped model: (name, rows, columns) per unit of hidden size
_LAYER = (
    ("self_attn.q_proj.weight", 1, 1),
    ("self_attn.k_proj.weight", 1, 1),
    ("self_attn.v_proj.weight", 1, 1),
    ("self_attn.o_proj.weight", 1, 1),
    ("mlp.gate_proj.weight", 4, 1),
    ("mlp.up_proj.weight", 4, 1),
    ("mlp.down_proj.weight", 1, 4),
    ("input_layernorm.weight", 1, 0),
    ("post_attention_layernorm.weight", 1, 0),
)


def model_tensors(layers: int, hidden: int = 8192) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a Llama-shaped model's tensors (9 per layer, 3 more)."""
    out = [("model.embed_tokens.weight", (128_256, hidden))]
    for i in range(layers):
        for name, rows, cols in _LAYER:
            shape = (rows * hidden, cols * hidden) if cols else (rows * hidden,)
            out.append((f"model.layers.{i}.{name}", shape))
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (128_256, hidden))]
    return out


def fsdp_metadata(layers: int, ranks: int, optimizer: bool = True, hidden: int = 8192) -> Any:
    """torch's `Metadata` of `ranks` FSDP2 ranks saving the model (and, with `optimizer`, Adam's
    two states and step per tensor), every tensor split along dim 0."""
    import torch
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    sd_meta: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple[str, ...]] = {}
    offsets = [0] * ranks  # bytes written so far to each rank's file
    paths = [f"__{r}_0.distcp" for r in range(ranks)]
    keys = []
    for name, shape in model_tensors(layers, hidden):
        keys.append((f"model.{name}", ("model", name), shape))
        if optimizer:
            for state in ("exp_avg", "exp_avg_sq"):
                keys.append((f"optim.state.{name}.{state}", ("optim", "state", name, state), shape))
            sd_meta[f"optim.state.{name}.step"] = m.BytesStorageMetadata()
    props = m.TensorProperties(dtype=torch.float32)
    for fqn, path, shape in keys:
        planner[fqn] = path
        rows = -(-shape[0] // ranks)
        chunks = []
        for r in range(ranks):
            start = min(r * rows, shape[0])
            size = torch.Size((min(rows, shape[0] - start), *shape[1:]))
            offset = torch.Size((start,) + (0,) * (len(shape) - 1))
            chunks.append(m.ChunkStorageMetadata(offsets=offset, sizes=size))
            length = 4 * size.numel()
            # each rank's write results reach rank 0 through its own pickle: a string per rank
            index = m.MetadataIndex(fqn=(fqn + ".")[:-1], offset=offset, index=r)
            storage[index] = _StorageInfo(relative_path=paths[r], offset=offsets[r], length=length)
            offsets[r] += length + 1024
        sd_meta[fqn] = m.TensorStorageMetadata(
            properties=props, size=torch.Size(shape), chunks=chunks
        )
    meta = m.Metadata(state_dict_metadata=sd_meta, planner_data=planner, storage_data=storage)
    meta.storage_meta = m.StorageMeta(checkpoint_id="/ckpt", save_id="a" * 32, load_id=None)
    meta.version = "1.0.0"
    return meta


def metadata_bytes(layers: int, ranks: int, optimizer: bool = True) -> bytes:
    """`fsdp_metadata` as ``FileSystemWriter.finish`` pickles it."""
    return pickle.dumps(fsdp_metadata(layers, ranks, optimizer))


def metadata_of_size(size: int, ranks: int = 256) -> bytes:
    """A real-shaped `.metadata` of at most about `size` bytes: as many layers as fit."""
    per_layer = len(metadata_bytes(2, ranks)) - len(metadata_bytes(1, ranks))
    layers = max(1, (size - len(metadata_bytes(0, ranks))) // per_layer)
    return metadata_bytes(layers, ranks)


def _repeat(unit: bytes, size: int, head: bytes = b"\x80\x04", tail: bytes = b"N.") -> bytes:
    return head + unit * max(1, (size - len(head) - len(tail)) // len(unit)) + tail


def _in_lists(item: bytes, size: int) -> bytes:
    """A list of lists of 1,000 `item`s each (APPENDS batches, as pickle writes them)."""
    batch = b"(" + item * 1000 + b"e"
    return b"\x80\x04]" + batch * max(1, (size - 4) // len(batch)) + b"."


def _deep_lists(size: int) -> bytes:
    """Lists nested as deep as `size` allows while the stack stays two items high."""
    out = bytearray(b"\x80\x04]\x94")
    for i in range(1, max(2, (size - 10) // 10)):
        out += b"]j" + (i - 1).to_bytes(4, "little") + b"a\x940"
    return bytes(out + b"j" + i.to_bytes(4, "little") + b".")


# crafted .metadata files of about a size, by what each byte makes (memoized, kept in
# containers, nested, or nothing at all): the attacks on the unpickler's time and memory
CRAFTED = {
    "memo fill": lambda size: _repeat(b"N\x940", size),
    "memoized sets": lambda size: _repeat(b"\x8f\x940", size),
    "memoized lists": lambda size: _repeat(b"]\x940", size),
    "memoized strings": lambda size: _repeat(b"\x8c\x03abc\x940", size),
    "strings in lists": lambda size: _in_lists(b"\x8c\x02ab", size),
    "numbers in lists": lambda size: _in_lists(b"M\x01\x02", size),
    "tuples in lists": lambda size: _in_lists(b"N\x85", size),
    "dicts in lists": lambda size: _in_lists(b"}", size),
    "one huge list": lambda size: b"\x80\x04](" + b"N" * max(1, size - 6) + b"e.",
    "deep nesting": _deep_lists,
    "nothing kept": lambda size: _repeat(b"N0", size),
}
