"""Map DCP keys to Hugging Face parameter names: constant tables and pure functions."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from shardforge.errors import CheckpointError
from shardforge.formats.state import is_optimizer_key

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

# segments that wrappers insert anywhere in a module path
WRAPPER_SEGMENTS: frozenset[str] = frozenset(
    {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
)
# segments that wrappers put in front of the module path (DDP)
LEADING_SEGMENTS: frozenset[str] = frozenset({"module"})
# how deep a wrapper prefix (model., state_dict., Lightning attribute, ...) may go
MAX_WRAPPER_DEPTH = 3


@dataclass(frozen=True)
class KeyMap:
    """DCP key -> HF name for the tensors kept; the rest listed by reason."""

    to_hf: dict[str, str]
    prefix: str
    skipped_optimizer: tuple[str, ...]
    unexpected: tuple[str, ...]


def clean_name(name: str) -> str:
    """Drop wrapper segments (`_orig_mod.`, `_fsdp_wrapped_module.`, ...) and a leading `module.`."""
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    while len(parts) > 1 and parts[0] in LEADING_SEGMENTS:
        parts = parts[1:]
    return ".".join(parts)


def _prefixes(names: Iterable[str]) -> set[str]:
    out = {""}
    for n in names:
        parts = n.split(".")
        for depth in range(1, min(MAX_WRAPPER_DEPTH, len(parts) - 1) + 1):
            out.add(".".join(parts[:depth]) + ".")
    return out


def map_keys(paths: Mapping[str, tuple[str, ...]], expected: Iterable[str]) -> KeyMap:
    """Choose the wrapper prefix that maps most keys onto `expected` HF names and apply it.

    `paths` maps each tensor's DCP key to its original path tuple (planner data). Optimizer
    entries are skipped; keys that do not map are returned as unexpected.
    """
    wanted = set(expected)
    optimizer = tuple(k for k, p in paths.items() if is_optimizer_key(p))
    cleaned = {k: clean_name(".".join(p)) for k, p in paths.items() if not is_optimizer_key(p)}
    best_prefix, best_hits = "", -1
    for prefix in sorted(_prefixes(cleaned.values()), key=len):
        hits = sum(
            1 for n in cleaned.values() if n.startswith(prefix) and n[len(prefix) :] in wanted
        )
        if hits > best_hits:
            best_prefix, best_hits = prefix, hits
    to_hf: dict[str, str] = {}
    unexpected: list[str] = []
    seen: dict[str, str] = {}
    for key, name in cleaned.items():
        hf = name[len(best_prefix) :] if name.startswith(best_prefix) else None
        if hf is None or hf not in wanted:
            unexpected.append(key)
            continue
        if hf in seen:
            raise CheckpointError(
                f"checkpoint keys {seen[hf]!r} and {key!r} both map to {hf!r}; ambiguous"
            )
        seen[hf] = key
        to_hf[key] = hf
    return KeyMap(to_hf, best_prefix, optimizer, tuple(sorted(unexpected)))


# ---------------------------------------------------------------- tied weights (one rule)


def stored_once(names: Iterable[str], tied: Mapping[str, str]) -> list[str]:
    """The names to store, in order: a tied target (`tied`: target -> source) is stored once,
    under its source, as `save_pretrained` does."""
    return [n for n in names if n not in tied]


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (NaNs and signed zeros compare exactly)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def check_tied_copies(
    tied: Mapping[str, str],
    stored: Mapping[str, T],
    read: Callable[[T], torch.Tensor],
    where: str,
) -> list[str]:
    """Compare both stored copies of every tied pair found in `stored` (name -> whatever
    `read` turns into the tensor); return the targets that were compared equal (they are
    dropped by `stored_once`). CheckpointError naming both keys when two copies differ: the
    model ties them, so one would be silently lost."""
    compared = []
    for target, source in tied.items():
        if target not in stored or source not in stored:
            continue
        a, b = read(stored[target]), read(stored[source])
        if not same_tensor(a, b):
            raise CheckpointError(
                f"{where}: stores the tied weights {target} and {source} with different "
                "values; the model ties them (tie_word_embeddings), so one would be lost. Set "
                "tie_word_embeddings: false in the model config if they are meant to differ"
            )
        compared.append(target)
        del a, b
    return compared


def tied_pairs(model: Any, config: Any) -> dict[str, str]:
    """The model's tied weights, target -> source, among its state-dict names (what
    `save_pretrained` stores once, under the source; `keys.stored_once` applies it)."""
    names = set(model.state_dict())
    return {t: s for t, s in _declared_ties(model, config).items() if t in names and s in names}


def _declared_ties(model: Any, config: Any) -> dict[str, str]:
    tied = getattr(model, "all_tied_weights_keys", None)  # transformers 5.x: target -> source
    if isinstance(tied, Mapping):
        return {str(k): str(v) for k, v in tied.items()}
    keys = getattr(model, "_tied_weights_keys", None)  # transformers 4.x: list of targets
    tie = getattr(config, "tie_word_embeddings", False)
    get_tie_config = getattr(config, "get_text_config", None)
    if callable(get_tie_config):
        tie = getattr(get_tie_config(), "tie_word_embeddings", tie)
    if tie and keys:
        emb = model.get_input_embeddings()
        source = next(n for n, p in model.named_parameters() if p is emb.weight)
        return {str(k): source for k in keys}
    return {}


TORCHTITAN = "torchtitan"
# first keys that only a torchtitan checkpoint has (HF names are `model.embed_tokens...`)
TITAN_MARKERS: tuple[str, ...] = ("tok_embeddings.weight", "layers.0.attention")


def looks_like_torchtitan(keys: list[str]) -> bool:
    """True when the keys use torchtitan's names (`tok_embeddings.weight`, `layers.0.attention`)."""
    names = [clean_name(k).removeprefix("model.") for k in keys]
    return any(n.startswith(TITAN_MARKERS) for n in names)
