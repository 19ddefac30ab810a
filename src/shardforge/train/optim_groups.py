"""The optimizer's parameter groups, as Axolotl (and the transformers Trainer under it) makes them.

- default: weights with weight decay; biases and norm weights without (transformers'
  `get_decay_parameter_names`); one group when weight_decay is 0.
- `embedding_lr` / `embedding_lr_scale` / `lr_groups` (Axolotl's grouping): embed_tokens and
  lm_head (and `modules_to_save` copies) in a group of their own without weight decay, at
  `embedding_lr` or learning_rate x `embedding_lr_scale`; the decayed weights of modules whose
  name contains an `lr_groups` entry's module at that entry's lr.
- `loraplus_lr_ratio` (LoRA+, PEFT's grouping): lora_B at learning_rate x the ratio, LoRA
  embeddings at `loraplus_lr_embedding`.
- `muon`: the 2-D hidden matrices for Muon, every other parameter (embeddings, head, norms,
  biases) for AdamW (`muon: True` in a group marks it).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from shardforge.config.schema import ShardforgeConfig

Group = dict[str, Any]
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
_EMBEDDINGS = ("embed_tokens", "lm_head")


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def decays(name: str) -> bool:
    """transformers' rule: no weight decay for biases and normalisation weights."""
    return not _NO_DECAY.search(name.lower())


def _is_embedding(name: str) -> bool:
    return name.endswith("modules_to_save.default.weight") or any(e in name for e in _EMBEDDINGS)


def _plain(params: list[tuple[str, torch.nn.Parameter]], cfg: ShardforgeConfig) -> list[Group]:
    if not cfg.weight_decay:  # one group, as the checkpoints of earlier versions hold
        return [{"params": [p for _, p in params], "weight_decay": 0.0}]
    decayed = [p for n, p in params if decays(n)]
    rest = [p for n, p in params if not decays(n)]
    groups = [{"params": decayed, "weight_decay": cfg.weight_decay}] if decayed else []
    return groups + ([{"params": rest, "weight_decay": 0.0}] if rest else [])


def _embedding_lr(cfg: ShardforgeConfig) -> float:
    if cfg.embedding_lr_scale is not None:
        return cfg.learning_rate * cfg.embedding_lr_scale
    return cfg.embedding_lr if cfg.embedding_lr is not None else cfg.learning_rate


def _axolotl(params: list[tuple[str, torch.nn.Parameter]], cfg: ShardforgeConfig) -> list[Group]:
    """Axolotl's `create_optimizer_grouped_parameters`."""
    lr, wd = cfg.learning_rate, cfg.weight_decay
    named = {g.name: list[torch.nn.Parameter]() for g in cfg.lr_groups or []}
    decayed: list[torch.nn.Parameter] = []
    embeddings: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for name, param in params:
        if _is_embedding(name):
            embeddings.append(param)
        elif decays(name):
            group = next(
                (g.name for g in cfg.lr_groups or [] if any(m in name for m in g.modules)), None
            )
            (named[group] if group is not None else decayed).append(param)
        else:
            rest.append(param)
    groups = [
        {"params": decayed, "weight_decay": wd, "lr": lr},
        {"params": embeddings, "weight_decay": 0.0, "lr": _embedding_lr(cfg)},
        {"params": rest, "weight_decay": 0.0, "lr": lr},
    ]
    groups += [
        {"params": named[g.name], "weight_decay": wd, "lr": g.lr} for g in cfg.lr_groups or []
    ]
    return [g for g in groups if g["params"]]


def _loraplus(model: torch.nn.Module, cfg: ShardforgeConfig) -> list[Group]:
    """PEFT's LoRA+ groups (`peft.optimizers.loraplus`): A, B (x ratio), LoRA embeddings."""
    from peft.tuners.lora import Embedding as LoraEmbedding

    assert cfg.loraplus_lr_ratio is not None
    lr, wd = cfg.learning_rate, cfg.weight_decay
    a: list[torch.nn.Parameter] = []
    b: list[torch.nn.Parameter] = []
    b_no_decay: list[torch.nn.Parameter] = []
    emb: list[torch.nn.Parameter] = []
    for name, param in _trainable(model):
        owner = ".".join(name.split(".")[:-2])  # lora_embedding_A.<adapter>
        if owner and isinstance(model.get_submodule(owner), LoraEmbedding):
            emb.append(param)
        elif "lora_B" in name or param.ndim == 1:
            (b if decays(name) else b_no_decay).append(param)
        else:
            a.append(param)
    ratio, emb_lr = cfg.loraplus_lr_ratio, cfg.loraplus_lr_embedding or 1e-6
    groups = [
        {"params": a, "weight_decay": wd, "lr": lr},
        {"params": emb, "weight_decay": wd, "lr": emb_lr},
        {"params": b, "weight_decay": wd, "lr": lr * ratio},
        {"params": b_no_decay, "weight_decay": 0.0, "lr": lr * ratio},
    ]
    return [g for g in groups if g["params"]]


def param_groups(model: torch.nn.Module, cfg: ShardforgeConfig) -> list[Group]:
    """The trainable parameters of `model` in the groups `cfg` asks for."""
    if cfg.loraplus_lr_ratio is not None:
        return _loraplus(model, cfg)
    params = _trainable(model)
    if cfg.embedding_lr is not None or cfg.embedding_lr_scale is not None or cfg.lr_groups:
        return _axolotl(params, cfg)
    return _plain(params, cfg)


def muon_split(model: torch.nn.Module, groups: list[Group]) -> list[Group]:
    """Each group split into its 2-D hidden matrices (`muon: True`) and the rest (AdamW)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: list[Group] = []
    for group in groups:
        hidden = [
            p for p in group["params"] if p.ndim == 2 and not _is_embedding(names.get(id(p), ""))
        ]
        ids = {id(p) for p in hidden}
        rest = [p for p in group["params"] if id(p) not in ids]
        out += [{**group, "params": hidden, "muon": True}] if hidden else []
        out += [{**group, "params": rest, "muon": False}] if rest else []
    return out
