"""Merges of the layouts other trainers write (verl, LMMs-Engine FSDP2 with EMA, torchtitan),
built by real gloo ranks as those tools write them, plus averaging, --format and --dry_run.

Each step's weights are the base model's plus a per-step constant (added on the ranks' local
shards), so steps differ and the expected tensors are computed exactly in the test.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.dist import run_on_ranks
from helpers.meshes import mesh_rank_files
from helpers.shared import shared_folder
from helpers.tiny import make_model
from shardforge.errors import CheckpointError, MergeError, ShardforgeError
from shardforge.merge.api import merge_fsdp_weights

# the checkpoints are written by gloo ranks
pytestmark = pytest.mark.slow

WORLD_SIZE = 2
# uneven shards over 2 ranks (vocab 331, intermediate 101)
SHAPES: dict[str, Any] = {
    "vocab_size": 331,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 101,
}
VERL_STEPS = (1, 2)
VERL_LATEST = 1  # latest_checkpointed_iteration.txt names step 1, not the highest (2)
LMMS_STEPS = (1, 2, 3)
TITAN_STEP = 5


def delta(tag: str, step: int) -> float:
    """The constant added to every floating tensor of a saved step."""
    return {"model": 0.01, "ema": -0.02}[tag] * step


def _perturbed(model: Any, amount: float, original: list[torch.Tensor] | None = None) -> None:
    """Every parameter := its original value + `amount` (one addition, as the test computes)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_((original[i] if original is not None else p) + amount)


def _fully_shard(model: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _save_rank_file(model: Any, folder: Path, rank: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / f"model_world_size_{WORLD_SIZE}_rank_{rank}.pt")


def titan_state(base: str) -> dict[str, torch.Tensor]:
    """The base model's full weights under torchtitan's names, q/k rows in torchtitan's
    interleaved RoPE order (the inverse of the adapter's permutation)."""
    from transformers import AutoModelForCausalLM

    from shardforge.keymap.titan.rope_permute import half_to_interleaved

    model = AutoModelForCausalLM.from_pretrained(base)
    cfg = model.config
    sd = model.state_dict()
    out: dict[str, torch.Tensor] = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
        "freqs_cis": torch.zeros(16, 8),  # a RoPE buffer: not a weight, dropped
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        t = f"layers.{i}."
        out[t + "attention.wq.weight"] = half_to_interleaved(
            sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads
        )
        out[t + "attention.wk.weight"] = half_to_interleaved(
            sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads
        )
        out[t + "attention.wv.weight"] = sd[p + "self_attn.v_proj.weight"]
        out[t + "attention.wo.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[t + "feed_forward.w1.weight"] = sd[p + "mlp.gate_proj.weight"]
        out[t + "feed_forward.w2.weight"] = sd[p + "mlp.down_proj.weight"]
        out[t + "feed_forward.w3.weight"] = sd[p + "mlp.up_proj.weight"]
        out[t + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[t + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


def save_layouts(rank: int, world_size: int, base: str, other: str, root: str) -> None:
    """On every rank: write the verl, LMMs-Engine (+ EMA), mixed-architecture and torchtitan
    trees under `root`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import AutoModelForCausalLM

    r = Path(root)
    model = AutoModelForCausalLM.from_pretrained(base)
    _fully_shard(model)
    original = [p.detach().clone() for p in model.parameters()]
    for step in sorted({*VERL_STEPS, *LMMS_STEPS}):
        _perturbed(model, delta("model", step), original)
        if step in VERL_STEPS:
            actor = r / "verl" / f"global_step_{step}" / "actor"
            _save_rank_file(model, actor, rank)
            if rank == 0:
                (actor / "fsdp_config.json").write_text(
                    json.dumps({"FSDP_version": 2, "world_size": world_size})
                )
                (actor / "huggingface").mkdir()
                for f in Path(base).iterdir():  # config, generation config, tokenizer
                    if not f.name.endswith(".safetensors"):
                        shutil.copy(f, actor / "huggingface" / f.name)
        if step in LMMS_STEPS:
            _save_rank_file(model, r / "lmms" / f"checkpoint-{step}" / "pytorch_model_fsdp_0", rank)
    if rank == 0:
        (r / "verl" / "latest_checkpointed_iteration.txt").write_text(f"{VERL_LATEST}\n")
    # EMA weights beside the model weights
    for step in LMMS_STEPS:
        _perturbed(model, delta("ema", step), original)
        _save_rank_file(model, r / "lmms" / f"checkpoint-{step}" / "pytorch_ema_model_fsdp_0", rank)
    # two steps of different architectures under one root (averaging must refuse them)
    _save_rank_file(model, r / "mixed" / "checkpoint-1" / "pytorch_model_fsdp_0", rank)
    odd = AutoModelForCausalLM.from_pretrained(other)
    _fully_shard(odd)
    _save_rank_file(odd, r / "mixed" / "checkpoint-2" / "pytorch_model_fsdp_0", rank)
    # torchtitan: its names, sharded on dim 0 as FSDP2 shards, saved with dcp.save
    mesh = init_device_mesh("cpu", (world_size,))
    titan: dict[str, Any] = {
        k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in titan_state(base).items()
    }
    # a training checkpoint's other states, which the merge skips
    emb = titan["tok_embeddings.weight"]
    titan["optimizer"] = {"state": {"tok_embeddings.weight": {"exp_avg": emb.clone()}}}
    titan["lr_scheduler"] = {"last_epoch": TITAN_STEP}
    titan["train_state"] = {"step": TITAN_STEP, "ntokens_seen": torch.tensor(1234)}
    dcp.save(titan, checkpoint_id=r / "titan" / f"step-{TITAN_STEP}")
    dist.barrier()


@dataclass(frozen=True)
class Built:
    root: Path
    base: Path
    other: Path


def _write_sources(root: Path) -> None:
    base = make_model(root / "base", "llama", seed=3, **SHAPES)
    other = make_model(root / "other", "llama", seed=4, **{**SHAPES, "intermediate_size": 99})
    run_on_ranks(save_layouts, WORLD_SIZE, str(base), str(other), str(root / "trees"))


def build_sources(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Every layout's checkpoint of one tiny model, written once per run (test_distributed
    merges its torchtitan step too); tests copy what they change."""
    root = shared_folder(tmp_path_factory, "merge-sources", _write_sources)
    return Built(root / "trees", root / "base", root / "other")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_sources(tmp_path_factory)


def expected_state(base: Path, amount: float) -> dict[str, torch.Tensor]:
    """The base model's state dict with `amount` added to every parameter (as on the ranks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    _perturbed(model, amount)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_merged(base: Path, merged: Path, state: dict[str, torch.Tensor]) -> None:
    """from_pretrained loads; every tensor bit-identical to `state`; logits equal."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(base).eval()
    ref.load_state_dict(state, strict=True)
    got = AutoModelForCausalLM.from_pretrained(merged).eval()
    got_sd = got.state_dict()
    assert got_sd.keys() == state.keys()
    for k, v in state.items():
        assert got_sd[k].dtype == v.dtype, k
        assert torch.equal(got_sd[k], v), k
    ids = torch.tensor([[1, 5, 9, 17, 33, 100, 250, 330]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)
    assert not list(merged.parent.glob(f".{merged.name}.*"))


def _cfg(base: Path, output_dir: Path) -> dict[str, Any]:
    return {"base_model": str(base), "output_dir": str(output_dir)}


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_verl_latest_from_its_file_with_huggingface_folder(built: Built, tmp_path: Path) -> None:
    # base_model is an empty folder: config, generation config and tokenizer must come from
    # the checkpoint's own huggingface/ folder
    empty = tmp_path / "no-model"
    empty.mkdir()
    out = merge_fsdp_weights(_cfg(empty, built.root / "verl"), tmp_path / "out", verify=True)
    assert_merged(built.base, out, expected_state(built.base, delta("model", VERL_LATEST)))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).chat_template


def test_verl_step_picks(built: Built, tmp_path: Path) -> None:
    cfg = _cfg(built.base, built.root / "verl")
    out = merge_fsdp_weights(cfg, tmp_path / "out", step=2)
    assert_merged(built.base, out, expected_state(built.base, delta("model", 2)))


def test_verl_latest_file_naming_a_missing_step(built: Built, tmp_path: Path) -> None:
    run = tmp_path / "verl"
    shutil.copytree(built.root / "verl", run)
    (run / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(CheckpointError, match="names step 7"):
        merge_fsdp_weights(_cfg(built.base, run), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_lmms_engine_latest_and_ema(built: Built, tmp_path: Path) -> None:
    cfg = _cfg(built.base, built.root / "lmms")
    out = merge_fsdp_weights(cfg, tmp_path / "out", verify=True)
    assert_merged(built.base, out, expected_state(built.base, delta("model", LMMS_STEPS[-1])))
    ema = merge_fsdp_weights(
        cfg, tmp_path / "ema", step=2, state_dict_dirname="pytorch_ema_model_fsdp_0"
    )
    assert_merged(built.base, ema, expected_state(built.base, delta("ema", 2)))


def test_rank_folder_given_directly(built: Built, tmp_path: Path) -> None:
    folder = built.root / "lmms" / "checkpoint-1" / "pytorch_model_fsdp_0"
    out = merge_fsdp_weights(_cfg(built.base, tmp_path), tmp_path / "out", checkpoint=folder)
    assert_merged(built.base, out, expected_state(built.base, delta("model", 1)))


@pytest.mark.parametrize("name", ["../checkpoint-1", "/etc", ""])
def test_state_dict_dirname_must_stay_inside(built: Built, tmp_path: Path, name: str) -> None:
    with pytest.raises(CheckpointError, match="inside the checkpoint"):
        merge_fsdp_weights(
            _cfg(built.base, built.root / "lmms"), tmp_path / "out", state_dict_dirname=name
        )


def test_torchtitan_step_dir(built: Built, tmp_path: Path) -> None:
    out = merge_fsdp_weights(_cfg(built.base, built.root / "titan"), tmp_path / "out", verify=True)
    assert_merged(built.base, out, expected_state(built.base, 0.0))


def test_torchtitan_unsupported_model_type(built: Built, tmp_path: Path) -> None:
    qwen = make_model(tmp_path / "qwen", "qwen2", **SHAPES)
    with pytest.raises(ShardforgeError, match="no torchtitan name adapter for model_type 'qwen2'"):
        merge_fsdp_weights(_cfg(qwen, built.root / "titan"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def mean_in_memory(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """fp32 accumulation in input order, divided by the count, cast back."""
    out = {}
    for k, v in states[0].items():
        acc = torch.zeros(v.shape, dtype=torch.float32)
        for s in states:
            acc += s[k].to(torch.float32)
        out[k] = acc.div_(len(states)).to(v.dtype)
    return out


def test_average_last_equals_the_mean_in_memory(built: Built, tmp_path: Path) -> None:
    cfg = _cfg(built.base, built.root / "lmms")
    out = merge_fsdp_weights(cfg, tmp_path / "out", average_last=2, verify=True)
    states = [expected_state(built.base, delta("model", s)) for s in LMMS_STEPS[-2:]]
    assert_merged(built.base, out, mean_in_memory(states))


def test_average_steps_of_ema(built: Built, tmp_path: Path) -> None:
    cfg = _cfg(built.base, built.root / "lmms")
    out = merge_fsdp_weights(
        cfg,
        tmp_path / "out",
        average_steps=[1, 3],
        state_dict_dirname="pytorch_ema_model_fsdp_0",
    )
    states = [expected_state(built.base, delta("ema", s)) for s in (1, 3)]
    assert_merged(built.base, out, mean_in_memory(states))


def test_average_refuses_different_architectures(built: Built, tmp_path: Path) -> None:
    with pytest.raises(MergeError) as exc:
        merge_fsdp_weights(
            _cfg(built.other, built.root / "mixed"), tmp_path / "out", average_last=2
        )
    # every input is checked against the architecture before anything is written
    assert "checkpoint-1/pytorch_model_fsdp_0: the checkpoint does not match" in str(exc.value)
    assert "mlp.gate_proj.weight [101, 64] vs [99, 64]" in str(exc.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"average_last": 5}, "has only 3"),
        ({"average_steps": [1, 9]}, "step(s) 9"),
        ({"average_last": 2, "step": 1}, "--step"),
    ],
)
def test_average_bad_options(
    built: Built, tmp_path: Path, options: dict[str, Any], words: str
) -> None:
    with pytest.raises(MergeError, match=None) as exc:
        merge_fsdp_weights(_cfg(built.base, built.root / "lmms"), tmp_path / "out", **options)
    assert words in str(exc.value)


def test_format_safetensors_single_file(built: Built, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cfg = _cfg(built.base, built.root / "lmms")
    out = merge_fsdp_weights(
        cfg, tmp_path / "merged.safetensors", output_format="safetensors", verify=True
    )
    assert out.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["merged.safetensors"]
    state = expected_state(built.base, delta("model", LMMS_STEPS[-1]))
    got = load_file(out)
    # tied / buffers aside, every saved tensor is there, bit for bit
    assert set(got) <= set(state) and "lm_head.weight" in got
    for k, v in got.items():
        assert v.dtype == state[k].dtype and torch.equal(v, state[k]), k


def test_format_torch_default_path_loads_weights_only(built: Built, tmp_path: Path) -> None:
    run = tmp_path / "lmms"
    shutil.copytree(built.root / "lmms" / "checkpoint-2", run / "checkpoint-2")
    out = merge_fsdp_weights(_cfg(built.base, run), None, output_format="torch", verify=True)
    assert out == (run / "checkpoint-2" / "pytorch_model_fsdp_0.consolidated").absolute()
    loaded = torch.load(out, weights_only=True, map_location="cpu")
    assert list(loaded) == ["state_dict"]
    state = expected_state(built.base, delta("model", 2))
    assert set(loaded["state_dict"]) <= set(state)
    for k, v in loaded["state_dict"].items():
        assert v.device.type == "cpu" and v.dtype == state[k].dtype, k
        assert torch.equal(v, state[k]), k
    assert not list(out.parent.glob(f".{out.name}.*"))


def test_dry_run_writes_nothing(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = tree_hash(built.root)
    for fmt, name in (("hf", "out"), ("safetensors", "m.safetensors"), ("torch", "m.pt")):
        out = merge_fsdp_weights(
            _cfg(built.base, built.root / "verl"),
            tmp_path / name,
            output_format=fmt,
            dry_run=True,
        )
        assert not out.exists()
        text = capsys.readouterr().out
        assert "dry run: nothing is written" in text
        assert f"global_step_{VERL_LATEST}" in text and "rank-files" in text
        assert "total bytes:" in text and "free disk at" in text and "float32" in text
    assert sorted(tmp_path.iterdir()) == []
    assert tree_hash(built.root) == before


def test_hsdp_rank_files(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """HSDP rank files in verl's layout: a (replicate 2, shard 2) mesh, each of 4 gloo ranks
    saving its DTensor state dict (`helpers.meshes`' hsdp/, written once per run), merged with
    --verify into the model they were saved from."""
    mesh = mesh_rank_files(tmp_path_factory)
    actor = tmp_path / "run" / "global_step_4" / "actor"
    actor.mkdir(parents=True)
    for rank_file in (mesh / "hsdp").iterdir():
        shutil.copy(rank_file, actor)
    out = merge_fsdp_weights(_cfg(mesh / "base", tmp_path / "run"), tmp_path / "out", verify=True)
    assert_merged(mesh / "base", out, expected_state(mesh / "base", 0.0))


def test_verl_fsdp_config_of_another_world_size(built: Built, tmp_path: Path) -> None:
    run = tmp_path / "verl"
    shutil.copytree(built.root / "verl", run)
    config = run / f"global_step_{VERL_LATEST}" / "actor" / "fsdp_config.json"
    config.write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    before = tree_hash(run)
    with pytest.raises(CheckpointError, match=r"says world_size 4.*world size 2"):
        merge_fsdp_weights(_cfg(built.base, run), tmp_path / "out")
    assert not (tmp_path / "out").exists() and tree_hash(run) == before


def test_all_steps_merges_each_step_to_its_folder(built: Built, tmp_path: Path) -> None:
    """--all_steps: every LMMs-Engine step to out/step-N, each what merging that step alone
    gives; --steps picks some; an unknown step is refused before anything is written."""
    cfg = _cfg(built.base, built.root / "lmms")
    out = merge_fsdp_weights(cfg, tmp_path / "all", all_steps=True, verify=True, quiet=True)
    assert sorted(p.name for p in out.iterdir()) == [f"step-{s}" for s in sorted(LMMS_STEPS)]
    for s in LMMS_STEPS:
        assert_merged(built.base, out / f"step-{s}", expected_state(built.base, delta("model", s)))
    some = merge_fsdp_weights(cfg, tmp_path / "some", steps=[LMMS_STEPS[0]], quiet=True)
    assert [p.name for p in some.iterdir()] == [f"step-{LMMS_STEPS[0]}"]
    with pytest.raises(MergeError, match=r"no complete checkpoint for step\(s\) 999"):
        merge_fsdp_weights(cfg, tmp_path / "bad", steps=[LMMS_STEPS[0], 999])
    assert not (tmp_path / "bad").exists()
    with pytest.raises(MergeError, match="cannot be combined with --step"):
        merge_fsdp_weights(cfg, tmp_path / "bad", all_steps=True, step=1)
