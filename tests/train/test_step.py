"""One optimizer step: this rank's micro-batches, the token-sum loss, the global-batch mean."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers.tiny import make_model
from shardforge.config import validate_cfg
from shardforge.train.data import IGNORE_INDEX, GlobalOrder, Sequences
from shardforge.train.runtime import Runtime
from shardforge.train.step import loss_sum, micro_batches, train_step

CPU = torch.device("cpu")


def _cfg(base: Path | str, **extra: Any) -> Any:
    return validate_cfg({"base_model": str(base), **extra})


def _batch(seed: int, rows: int = 2, length: int = 10) -> Sequences:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (rows, length), generator=gen)
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX  # a prompt that is not trained on
    return Sequences(ids, labels, torch.ones_like(ids))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("step") / "base", "llama", vocab_size=301)


def test_micro_batches_partition_the_global_batch() -> None:
    seqs = _batch(0, rows=20)
    order = GlobalOrder(20, seed=3)
    cfg = _cfg("unused", micro_batch_size=2, gradient_accumulation_steps=2)
    consumed = 8  # global batch 2 (ranks) x 2 (micro) x 2 (rows) = 8, the second one
    taken: list[list[int]] = []
    for rank in range(2):
        rt = Runtime(rank, 2, rank, CPU)
        for micro in micro_batches(seqs, order, consumed, cfg, rt):
            assert len(micro) == 2
            taken.append([int(r) for r in micro.input_ids[:, 0]])
    want = sorted(int(seqs.input_ids[i, 0]) for i in order.indices(consumed, 8))
    assert sorted(t for part in taken for t in part) == want


def test_loss_sum_is_the_sum_over_target_tokens(base: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    batch = _batch(1)
    logits = model(input_ids=batch.input_ids).logits.float()
    per_token = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        batch.labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    got = loss_sum(model, batch, CPU)
    assert got.dtype == torch.float32
    assert torch.allclose(got, per_token.sum(), rtol=1e-6)
    targets = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
    assert int((per_token != 0).sum()) == targets


def test_train_step_is_the_global_batch_mean(base: Path, one_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(base)
    model = copy.deepcopy(reference)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    cfg = _cfg(base, max_grad_norm=0.5, gradient_accumulation_steps=2)
    batches = [_batch(2), _batch(3)]

    def sgd(m: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    opt, sched = sgd(model)
    got = train_step(model, opt, sched, batches, cfg, Runtime(0, 1, 0, CPU))

    ref_opt, _ = sgd(reference)
    targets = sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in batches)
    total = sum(loss_sum(reference, b, CPU) for b in batches)
    assert isinstance(total, torch.Tensor)
    (total / targets).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5))
    ref_opt.step()

    assert math.isclose(got["loss"], float(total.detach()) / targets, rel_tol=1e-5)
    assert math.isclose(got["grad_norm"], norm, rel_tol=1e-4) and norm > 0.5  # clipped
    assert got["tokens"] == sum(int(b.attention_mask.sum()) for b in batches)
    assert got["lr"] == 0.1
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.full_tensor(), q, atol=1e-6), name  # type: ignore[operator]
