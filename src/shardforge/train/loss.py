"""The training loss: the summed cross-entropy of a batch's target tokens, with or without the
full logits.

    token_loss_sum(model, inputs, labels, chunks)  the sum over target tokens (float32)
    token_losses(model, inputs, labels, chunks)    each token's loss, [batch, seq - 1] (0 where
                                                   the label is ignored), for evaluation
    loss_chunks(cfg, model)                        the chunks the loss of `model` uses (0: plain)
    use_fused_loss(model, kernel)                  a kernel's fused head + loss instead (Liger,
                                                   Cut Cross Entropy: train.kernels)
    not_exact(model)                               why chunking would change this model's loss
                                                   (None: it would not)

The plain loss takes the model's logits, [batch, seq, vocab], and their float32 copy (4.2 GB at
4 x 2048 x 128,256; their gradient as much again). The chunked loss never holds them: the model
runs with its output head (`lm_head`) replaced, for that one call, by a function of the final
hidden states that, chunk by chunk along the sequence, applies the real head, takes the chunk's
float32 cross-entropy and keeps only its sum; each chunk is checkpointed
(`torch.utils.checkpoint`), so backward recomputes that chunk's logits alone. The loss is the
same sum of the same token losses (in another order of addition) and the gradients the same.

It runs inside the model's own forward, so everything around the head still happens as it does
without it: FSDP2's root unit gathers the head's weight (tied to the embedding or not) for
forward and again for backward's recomputation and reduces its gradient, mixed precision casts
it, and a LoRA layer or `modules_to_save` copy on the head is the module that is called.
That needs a forward whose logits are the head applied to the decoder's last hidden states and
nothing else: `not_exact` reads the forward's code (soft-capping, logit scaling, a hidden-state
multiplier make it inexact), and then `chunked_cross_entropy: true` is refused. It is off
unless asked for (null or false: Axolotl's default): it adds a recomputation of the logits in
backward (2 x vocabulary x hidden FLOPs per token) and its gain on a GPU is unmeasured.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import math
import re
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.train.data import IGNORE_INDEX

DEFAULT_CHUNKS = 8  # Axolotl's chunked_cross_entropy_num_chunks default

Head = Callable[[torch.Tensor], torch.Tensor]
# a kernel's fused head + loss: (hidden [n, dim], head weight [vocab, dim], targets [n]) -> sum
FusedLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_FUSED = "_shardforge_fused_loss"

# what a forward may do between the decoder's output and the head (transformers' causal LMs)
_HIDDEN = re.compile(r"^hidden_states = (\w+)(\.last_hidden_state|\[0\])$")
_BETWEEN = frozenset(
    {
        "hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)",
        "slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) "
        "else logits_to_keep",
    }
)
_HEAD_CALLS = frozenset(
    {
        "logits = self.lm_head(hidden_states)",
        "logits = self.lm_head(hidden_states[:, slice_indices, :])",
    }
)


# -- which loss ------------------------------------------------------------------------------------


def loss_chunks(cfg: ShardforgeConfig, model: nn.Module) -> int:
    """The chunks `model`'s loss uses: 0 for the plain loss (null or false: Axolotl's default,
    off). `chunked_cross_entropy: true` on a model whose loss chunking would change is a
    ConfigError."""
    if not cfg.chunked_cross_entropy:
        return 0
    problem = not_exact(model)
    if problem is None:
        return cfg.chunked_cross_entropy_num_chunks or DEFAULT_CHUNKS
    raise ConfigError(
        "chunked_cross_entropy",
        [
            f"the chunked loss would not be exact for {type(model).__name__}: {problem}; "
            "remove the key (the plain loss is used then)"
        ],
    )


def describe(cfg: ShardforgeConfig, model: nn.Module) -> str:
    """The loss `model` trains with, for the log."""
    if _FUSED in model.__dict__:
        return "loss: the kernel's fused output head + cross-entropy (plugins; no full logits)"
    chunks = loss_chunks(cfg, model)
    if chunks:
        return f"loss: chunked cross-entropy ({chunks} chunks of the sequence; no full logits)"
    return "loss: cross-entropy over the full logits (chunked_cross_entropy: off)"


def not_exact(model: nn.Module) -> str | None:
    """Why the chunked loss would differ from the plain one for `model` (None: it would not)."""
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        return "it has no `lm_head` output head"
    return _forward_problem(type(model).forward)


@functools.cache
def _forward_problem(forward: Callable[..., Any]) -> str | None:
    """None when the model class's `forward` computes `logits = self.lm_head(hidden_states)` from the
    decoder's last hidden states (sliced by logits_to_keep at most) and never changes them."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return "the source of its forward cannot be read"
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
        return "the source of its forward cannot be read"
    lines = [ast.unparse(stmt) for stmt in fn.body]
    head = next((i for i, line in enumerate(lines) if line in _HEAD_CALLS), None)
    if head is None:
        return "its forward does not compute `logits = self.lm_head(hidden_states)`"
    at = head - 1
    while at >= 0 and lines[at] in _BETWEEN:
        at -= 1
    found = _HIDDEN.match(lines[at]) if at >= 0 else None
    if found is None or not _decoder_call(fn.body[at - 1] if at > 0 else None, found.group(1)):
        return "its forward changes the hidden states before the output head"
    for stmt in fn.body[head + 1 :]:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and node.id == "logits" and _stores(node):
                return "its forward changes the logits after the output head"
    return None


def _decoder_call(stmt: ast.stmt | None, name: str) -> bool:
    """`stmt` is `<name> = self.<decoder>(...)`."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target, value = stmt.targets[0], stmt.value
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        target, value = stmt.target, stmt.value
    else:
        return False
    called = value.func if isinstance(value, ast.Call) else None
    return (
        isinstance(target, ast.Name)
        and target.id == name
        and isinstance(called, ast.Attribute)
        and isinstance(called.value, ast.Name)
        and called.value.id == "self"
    )


def _stores(node: ast.Name) -> bool:
    return isinstance(node.ctx, ast.Store | ast.Del)


# -- the losses ------------------------------------------------------------------------------------


def token_loss_sum(
    model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, chunks: int = 0
) -> torch.Tensor:
    """The sum of the token losses of a batch (float32): token t predicts labels[:, t + 1];
    IGNORE_INDEX labels count nothing. `chunks` > 0: without the full logits."""
    fused = model.__dict__.get(_FUSED)
    if fused is not None:  # a kernel's (train.kernels), in the head's place as the chunks are
        with _head_replaced(model, functools.partial(_fused, labels=labels, loss=fused)):
            summed: torch.Tensor = model(**inputs).logits
        return summed.float()
    if chunks <= 0:
        logits = model(**inputs).logits
        return _cross_entropy(logits[:, :-1], labels[:, 1:], "sum")
    with _head_replaced(model, functools.partial(_chunked, labels=labels, chunks=chunks)):
        out: torch.Tensor = model(**inputs).logits
    return out


def token_losses(
    model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, chunks: int = 0
) -> torch.Tensor:
    """Each token's loss, [batch, seq - 1] float32 (0 where the label is ignored)."""
    if chunks <= 0:
        logits = model(**inputs).logits
        return _cross_entropy(logits[:, :-1], labels[:, 1:], "none")
    per_token = functools.partial(_chunked, labels=labels, chunks=chunks, reduction="none")
    with _head_replaced(model, per_token):
        out: torch.Tensor = model(**inputs).logits
    return out


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """float32 cross-entropy of [batch, n, vocab] logits against [batch, n] targets: the sum,
    or the [batch, n] token losses (`none`)."""
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )
    return loss if reduction == "sum" else loss.view(targets.shape)


def _chunked(
    head: Head, hidden: torch.Tensor, *, labels: torch.Tensor, chunks: int, reduction: str = "sum"
) -> torch.Tensor:
    """The loss of the final hidden states [batch, seq, dim], chunk by chunk along the
    sequence; each chunk's logits recomputed in backward (checkpointed) when grad is on."""
    hidden, targets = hidden[:, :-1], labels.to(hidden.device)[:, 1:]
    size = max(1, math.ceil(hidden.shape[1] / chunks))
    parts = []
    for h, y in zip(hidden.split(size, dim=1), targets.split(size, dim=1), strict=True):
        if torch.is_grad_enabled():
            part = torch.utils.checkpoint.checkpoint(
                _chunk_loss, head, h, y, reduction, use_reentrant=False
            )
        else:
            part = _chunk_loss(head, h, y, reduction)
        parts.append(part)
    if reduction == "sum":
        return torch.stack(parts).sum()
    return torch.cat(parts, dim=1)


def use_fused_loss(model: nn.Module, loss: FusedLoss) -> None:
    """Train `model` with a kernel's fused head + loss (Liger's, Cut Cross Entropy's) in place
    of the chunked loss; evaluation keeps the chunked per-token losses (the same values)."""
    model.__dict__[_FUSED] = loss


def _fused(head: Head, hidden: torch.Tensor, *, labels: torch.Tensor, loss: FusedLoss) -> Any:
    """The summed loss of the final hidden states through the head's own weight (gathered by
    FSDP2 for this forward), by the kernel."""
    weight = head.__self__.weight  # type: ignore[attr-defined]
    targets = labels.to(hidden.device)[:, 1:].reshape(-1)
    return loss(hidden[:, :-1].reshape(-1, hidden.shape[-1]), weight, targets)


def _chunk_loss(head: Head, hidden: torch.Tensor, targets: torch.Tensor, reduction: str) -> Any:
    return _cross_entropy(head(hidden), targets, reduction)


@contextlib.contextmanager
def _head_replaced(model: nn.Module, loss: Callable[..., torch.Tensor]) -> Iterator[None]:
    """For one forward of `model`: its `lm_head` call returns `loss(head, hidden_states)`,
    `head` the head's own forward (the module, its hooks and parameters stay as they are)."""
    module = model.lm_head
    assert isinstance(module, nn.Module)
    own = module.__dict__.get("forward")  # an instance-level forward someone else set
    original = module.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return loss(original, hidden)

    module.forward = forward
    try:
        yield
    finally:
        if own is not None:
            module.forward = own
        else:
            del module.forward
