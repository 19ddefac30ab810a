"""A folder built once per test run and shared by every test and xdist worker that asks for it
(an expensive input, such as checkpoints written by gloo ranks, that tests only read).

    root = shared_folder(tmp_path_factory, "inspect-checkpoints", build)   # build(root)

Tests must not change what is in it (copy first). The builder starts child processes, so a
test that gets the folder counts as starting them (`helpers.children`), whether it built the
folder or found it built; a builder that starts none says so (`starts_children=False`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers import children


def shared_folder(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    build: Callable[[Path], object],
    starts_children: bool = True,
) -> Path:
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this run's folder, the same for every xdist worker
    root = shared / name
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "DONE").exists():
            if starts_children:
                children.started(f"{name}: shared, built by another test's child processes")
        else:
            shutil.rmtree(root, ignore_errors=True)  # what a failed build left
            build(root)
            (root / "DONE").touch()
    return root


# -- checkpoints written by each format's own saving API, on 2 gloo ranks, in one launch ------

FORMATS_WORLD = 2
LORA_SETTINGS = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


# saved as a plain tensor by every rank (a replicated buffer), the others as Shard(0) DTensors
REPLICATED = "model.rotary.scale"


def contract_tensors(floats_only: bool = False) -> dict[str, Any]:
    """The tensors every format's contract fixture holds: floats of uneven shapes (over 2 ranks
    `model.tiny.bias` leaves rank 1 an empty shard), one replicated plain tensor and, unless
    `floats_only` (torch's safetensors consolidator refuses the others), int64, bool and uint8
    tensors."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = {
        "model.embed.weight": torch.arange(42, dtype=torch.float32).reshape(7, 6) / 7,
        "model.norm.weight": torch.linspace(-1, 1, 6, dtype=torch.float32),
        "model.layers.0.proj.weight": torch.randn(5, 6, generator=g),
        "model.tiny.bias": torch.randn(1, 3, generator=g),
        REPLICATED: torch.linspace(0.5, 2, 4, dtype=torch.float32),
    }
    if not floats_only:
        out["model.steps"] = torch.arange(5, dtype=torch.int64) * 1_000_003 - 7
        out["model.mask"] = torch.tensor([[True, False], [False, True], [True, True]])
        out["model.blocks"] = torch.arange(24, dtype=torch.uint8).reshape(4, 6) * 10
    return out


def _perturbed(model: Any, seed: int, only: str = "") -> Any:
    """`model` with every parameter (whose name holds `only`) moved by seeded noise, the same
    on every rank: a merge that read the base model instead would differ."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only in name:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02)
    return model


def _shard(model: Any, layers: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def _save_contract(rank: int, world: int, out: Path) -> None:
    """The contract tensors as Shard(0) DTensors, in each format by its own writer."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def sharded(floats_only: bool = False) -> dict[str, Any]:
        return {
            k: t if k == REPLICATED else distribute_tensor(t, mesh, [Shard(0)])
            for k, t in contract_tensors(floats_only).items()
        }

    (out / "rank-files").mkdir(parents=True, exist_ok=True)
    torch.save(sharded(), out / "rank-files" / f"model_world_size_{world}_rank_{rank}.pt")
    dcp.save(sharded(), checkpoint_id=out / "dcp-ranks", use_collectives=False)
    writer = HuggingFaceStorageWriter(str(out / "dcp-safetensors"), save_distributed=True)
    dcp.save(sharded(), storage_writer=writer)
    writer = HuggingFaceStorageWriter(
        str(out / "consolidated"), save_distributed=True, enable_consolidation=True
    )
    dcp.save(sharded(floats_only=True), storage_writer=writer)


def _save_model(rank: int, base: str, out: Path, accelerator: Any) -> None:
    """A perturbed tiny Llama, fully_shard-ed, saved by accelerate's save_fsdp_model
    (use_dcp=False, with its optimizer files), dcp.save(use_collectives=False) and DCP's
    HuggingFaceStorageWriter (sharded, and consolidated in a torchtitan step-N/); the full
    state dict in trained/ (an HF directory)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    from transformers import AutoModelForCausalLM

    model = _perturbed(AutoModelForCausalLM.from_pretrained(base), seed=1)
    if rank == 0:
        model.save_pretrained(out / "trained")
    _shard(model, model.model.layers)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    step = out / "accelerate" / "checkpoint_1"
    save_fsdp_model(plugin, accelerator, model, str(step), use_dcp=False)
    state = get_model_state_dict(model, options=StateDictOptions())
    dcp.save(state, checkpoint_id=out / "collective-free" / "checkpoint-2", use_collectives=False)
    sharded = HuggingFaceStorageWriter(str(out / "hf-sharded"), save_distributed=True)
    dcp.save(state, storage_writer=sharded)
    titan = HuggingFaceStorageWriter(
        str(out / "titan" / "step-4"), save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=titan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(4, 300, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(step), use_dcp=False)


def _save_adapter(rank: int, base: str, out: Path, accelerator: Any) -> None:
    """A LoRA adapter of the tiny Llama saved by accelerate's save_fsdp_model(adapter_only=True,
    use_dcp=False); the adapter as PEFT saves it in lora-expected/."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(task_type="CAUSAL_LM", **LORA_SETTINGS)  # type: ignore[arg-type]
    torch.manual_seed(0)  # lora_A's random start: the same on every rank
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    _perturbed(model, seed=2, only="lora_")
    step = out / "accelerate-lora" / "checkpoint_1"
    if rank == 0:
        model.save_pretrained(out / "lora-expected")
        config.save_pretrained(step)
    _shard(model, model.base_model.model.model.layers)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    save_fsdp_model(plugin, accelerator, model, str(step), adapter_only=True, use_dcp=False)


def _save_formats(rank: int, world: int, base: str, root: str) -> None:
    import warnings

    from accelerate import Accelerator

    out = Path(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _save_contract(rank, world, out / "contract")
        accelerator = Accelerator(cpu=True)  # save_fsdp_model logs through accelerate's state
        _save_model(rank, base, out, accelerator)
        _save_adapter(rank, base, out, accelerator)


def _build_formats(root: Path) -> None:
    from helpers.dist import run_on_ranks
    from helpers.tiny import make_model

    # vocab 331 and intermediate 101 do not split evenly over 2 ranks
    base = make_model(root / "base", "llama", vocab_size=331, intermediate_size=101)
    run_on_ranks(_save_formats, FORMATS_WORLD, str(base), str(root))


def saved_formats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints of the formats read through other writers than shardforge's (built
    once per run, one launch of 2 gloo ranks):

    - contract/<format>/: `contract_tensors()` as Shard(0) DTensors: rank-files (torch.save),
      dcp-ranks (dcp.save use_collectives=False), dcp-safetensors (HuggingFaceStorageWriter
      save_distributed=True), consolidated (the same, enable_consolidation=True; floats only);
    - base/ (a tiny Llama), trained/ (it perturbed: the full state dict the others hold);
    - accelerate/checkpoint_1/: save_fsdp_model(use_dcp=False) + save_fsdp_optimizer;
    - collective-free/checkpoint-2/: dcp.save(use_collectives=False);
    - hf-sharded/: HuggingFaceStorageWriter(save_distributed=True);
    - titan/step-4/: the same with enable_consolidation=True (torchtitan's last_save_in_hf);
    - accelerate-lora/checkpoint_1/: save_fsdp_model(adapter_only=True, use_dcp=False) and
      adapter_config.json; lora-expected/: that adapter as PEFT saves it (base/ is its base).
    """
    return shared_folder(tmp_path_factory, "saved-formats", _build_formats)


# -- what the format tests check on each -------------------------------------------------------


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> SHA-256 of every file under `root` (to show an input unchanged)."""
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def merge_refused(base: Path, checkpoint: Path, out: Path, **options: Any) -> str:
    """The merge of `checkpoint` refused as every bad input is: a ShardforgeError whose message
    is one printable line of at most 300 characters, nothing at `out`, the checkpoint unchanged.
    Returns the message."""
    from shardforge.errors import ShardforgeError
    from shardforge.merge.api import merge_fsdp_weights

    before = tree_digest(checkpoint)
    cfg = {"base_model": str(base), "output_dir": str(out.parent)}
    with pytest.raises(ShardforgeError) as info:
        merge_fsdp_weights(cfg, out, checkpoint=checkpoint, quiet=True, **options)
    message = info.value.message
    assert "\n" not in message and len(message) <= 300, message
    assert message.isprintable() and "Traceback" not in message, message
    assert not out.exists()
    assert tree_digest(checkpoint) == before
    return message


def logits(model_dir: Path, adapter: Path | None = None) -> Any:
    """The logits transformers computes for a fixed batch with the model in `model_dir` (and
    the PEFT adapter in `adapter`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    ids = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def merges_to_the_trained_model(saved: Path, checkpoint: Path, out: Path, **options: Any) -> Path:
    """Merge `checkpoint` (of `saved_formats`' tiny Llama) with --verify to `out`: the output
    holds the trained tensors bit for bit and transformers computes the trained logits."""
    import torch
    from safetensors.torch import load_file

    from shardforge.merge.api import merge_fsdp_weights

    cfg = {"base_model": str(saved / "base"), "output_dir": str(out.parent)}
    merged = merge_fsdp_weights(cfg, out, checkpoint=checkpoint, verify=True, quiet=True, **options)
    got = load_file(merged / "model.safetensors")
    want = load_file(saved / "trained" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(logits(merged), logits(saved / "trained"))
    return merged
