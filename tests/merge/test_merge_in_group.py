"""A merge inside an initialised process group (issue 20, bug 1): called on rank 0 only, as
Axolotl and accelerate scripts do (`if is_main_process: merge_fsdp_weights(...)`), it merges in
that process: complete, and equal to a plain merge. It used to take the distributed path and
wait for the other ranks until the group's timeout (then print a raw gloo error). With
`group=dist.group.WORLD` on every rank, it merges on the ranks.

Two real gloo ranks with a short process-group timeout, so that a merge waiting for a rank
that never comes fails in seconds instead of hanging for the default 30 minutes."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from helpers.preloaded import start_preloaded
from helpers.tiny import make_model

# a collective that waits longer than this fails (the old code's hang)
TIMEOUT_S = 30
# how long rank 1 waits for rank 0's merge in this process (a slow, shared machine)
WAIT_S = 300
OK = "ok"


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _attempt(merge: Callable[[], object]) -> str:
    """OK, or the error the merge raised."""
    try:
        merge()
    except BaseException:
        return traceback.format_exc()
    return OK


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def _warm_up(cfg: str) -> None:
    """Load what a merge loads first (transformers, the model's classes), so that the ranks
    meet in the merge's collectives at about the same time, well within the short timeout."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = yaml.safe_load(Path(cfg).read_text())["base_model"]
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))


def merge_on_rank0_then_on_both(rank: int, world: int, store: str, cfg: str, root: str) -> None:
    """Rank 0 merges alone while rank 1 waits outside any collective; then both ranks merge
    with `group=`. Outcomes go to files (a failing rank must not stop the other's report)."""
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    from shardforge import merge_fsdp_weights

    _warm_up(cfg)

    out = Path(root)
    if rank == 0:
        alone = _attempt(lambda: merge_fsdp_weights(cfg, out / "rank0-only", quiet=True))
        (out / "rank0-only.result").write_text(alone)
        (out / "rank0-done").touch()
    else:
        _wait_for(out / "rank0-done")
    if (out / "rank0-only.result").read_text() != OK:
        return  # the group may be broken by a timed-out collective: stop here
    dist.barrier()
    both = _attempt(
        lambda: merge_fsdp_weights(cfg, out / "on-ranks", quiet=True, group=dist.group.WORLD)
    )
    (out / f"on-ranks.{rank}.result").write_text(both)
    dist.destroy_process_group()  # at once, as a caller does: the merge finished together


@pytest.mark.slow
def test_a_merge_on_rank0_only_inside_a_process_group(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from shardforge import merge_fsdp_weights

    base = make_model(tmp_path / "base", "llama", vocab_size=320)
    ckpt = tmp_path / "run" / "checkpoint-1"
    sd = AutoModelForCausalLM.from_pretrained(base).state_dict()
    dcp.save(sd, checkpoint_id=ckpt / "model", no_dist=True)
    (ckpt / "trainer_state.json").write_text('{"format": "shardforge", "step": 1}')
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(base), "output_dir": str(tmp_path / "run")}))
    plain = _tree(merge_fsdp_weights(cfg, tmp_path / "plain", quiet=True))

    out = tmp_path / "ranks"
    out.mkdir()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardforge-group-") as store:
        # the ranks start with torch and transformers imported (once, not per rank)
        start_preloaded(
            merge_on_rank0_then_on_both, 2, (2, str(Path(store) / "store"), str(cfg), str(out))
        )
    alone = (out / "rank0-only.result").read_text()
    assert alone == OK, f"after {time.monotonic() - started:.0f} s:\n{alone}"
    assert _tree(out / "rank0-only") == plain  # complete, and the plain merge's bytes
    for rank in (0, 1):
        assert (out / f"on-ranks.{rank}.result").read_text() == OK
    assert _tree(out / "on-ranks") == plain
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["on-ranks", "rank0-only"]
