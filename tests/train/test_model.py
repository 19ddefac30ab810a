"""The training model: meta build, wrap classes, sharded base-weight loading, global grad norm."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.dist import run_on_ranks
from helpers.tiny import make_model
from shardforge.config import validate_cfg
from shardforge.errors import ConfigError
from shardforge.train.data import Sequences
from shardforge.train.model import (
    build_meta_model,
    compute_dtypes,
    materialize_and_load,
    shard_model,
    wrap_classes,
)


def _cfg(base: Path, **extra: Any) -> Any:
    return validate_cfg({"base_model": str(base), **extra})


MODEL_TYPES = ("llama", "qwen2")


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # odd vocab and hidden sizes: no shard boundary falls evenly on 2 ranks
    root = tmp_path_factory.mktemp("bases")
    return {
        t: make_model(root / t / "base", t, vocab_size=331, hidden_size=72) for t in MODEL_TYPES
    }


@pytest.fixture(scope="module", params=MODEL_TYPES)
def base(request: pytest.FixtureRequest, bases: dict[str, Path]) -> Path:
    return bases[request.param]


def test_meta_build_has_no_weights_and_real_buffers(base: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = build_meta_model(_cfg(base))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    reference = dict(AutoModelForCausalLM.from_pretrained(base).named_buffers())
    buffers = dict(model.named_buffers())
    assert set(buffers) == set(reference) and buffers
    for name, buf in buffers.items():
        assert torch.equal(buf, reference[name]), name


def test_wrap_classes_auto_detected_or_named(base: Path) -> None:
    model = build_meta_model(_cfg(base))
    auto = wrap_classes(model, None)
    assert [c.__name__ for c in auto] == [type(model.model.layers[0]).__name__]
    with pytest.raises(ConfigError, match=r"fsdp.transformer_layer_cls_to_wrap.*NoSuchLayer"):
        wrap_classes(model, ["NoSuchLayer"])


def test_mixed_precision_dtypes() -> None:
    base = "unused"
    assert compute_dtypes(_cfg(base)) == (None, None)
    assert compute_dtypes(_cfg(base, bf16=True)) == (torch.bfloat16, torch.float32)
    mp = {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}}
    assert compute_dtypes(_cfg(base, fsdp=mp)) == (torch.bfloat16, torch.bfloat16)
    assert compute_dtypes(_cfg(base, bf16="auto"))[0] in (None, torch.bfloat16)


def _check_sharded_model(rank: int, world_size: int, base: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from shardforge.train.step import grad_norm_and_clip, loss_sum

    cfg = _cfg(Path(base))
    model = build_meta_model(cfg)
    shard_model(model, cfg, init_device_mesh("cpu", (world_size,)))
    materialize_and_load(model, cfg, torch.device("cpu"), rank)
    reference = AutoModelForCausalLM.from_pretrained(base)

    # every rank holds a proper slice, and together they are the base weights, bit for bit
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for key, tensor in reference.state_dict().items():
        assert torch.equal(full[key], tensor), key
    for name, buf in reference.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 331, (2, 12), generator=gen)
    batch = Sequences(ids, ids.clone(), torch.ones_like(ids))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)

    # the norm used for clipping is the global one over all shards (= the unsharded norm)
    loss_sum(model, batch, torch.device("cpu")).backward()
    norm = grad_norm_and_clip(model, None)
    loss_sum(reference, batch, torch.device("cpu")).backward()
    want = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    assert math.isclose(norm, want, rel_tol=1e-6), (norm, want)
    local = [p.grad.to_local() for p in model.parameters()]  # type: ignore[union-attr]
    assert not math.isclose(float(torch.nn.utils.get_total_norm(local)), want, rel_tol=1e-3)

    # the chunked loss (train.loss) on 2 ranks: the head (tied to the embedding in qwen2) in
    # the root unit, gathered for forward and for backward's recomputation: the plain loss
    # and gradients within 1e-5
    model.zero_grad()
    plain = loss_sum(model, batch, torch.device("cpu"))
    plain.backward()
    want = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    model.zero_grad()
    chunked = loss_sum(model, batch, torch.device("cpu"), chunks=5)
    chunked.backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        got = p.grad.to_local()  # type: ignore[union-attr]
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5, msg=name)

    # activation checkpointing recomputes the same forward: identical loss and gradients
    ac_cfg = _cfg(Path(base), fsdp={"activation_checkpointing": True})
    ac = build_meta_model(ac_cfg)
    shard_model(ac, ac_cfg, init_device_mesh("cpu", (world_size,)))
    materialize_and_load(ac, ac_cfg, torch.device("cpu"), rank)
    ac.train()
    assert all(getattr(layer, "gradient_checkpointing", False) for layer in ac.model.layers)
    model.zero_grad()
    loss = loss_sum(model, batch, torch.device("cpu"))
    loss.backward()
    ac_loss = loss_sum(ac, batch, torch.device("cpu"))
    ac_loss.backward()
    assert torch.equal(loss, ac_loss)
    for (name, p), q in zip(model.named_parameters(), ac.parameters(), strict=True):
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), name  # type: ignore[union-attr]

    # FULL_STATE_DICT's final save: a regular (here: sharded, indexed) HF directory
    from shardforge.train.full_save import save_full_model

    Path(out).mkdir(exist_ok=True)
    save_full_model(Path(out), model, reference.config, max_shard_size="40KB")
    dist.barrier()


def _check_each(rank: int, world_size: int, bases: dict[str, str], root: str) -> None:
    """`_check_sharded_model` for every base, its save in root/<type>-full (one launch of
    ranks for all; a failed check fails the launch, naming the assertion)."""
    for model_type, base in bases.items():
        _check_sharded_model(rank, world_size, base, f"{root}/{model_type}-full")


@pytest.fixture(scope="module")
def on_two_ranks(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every base checked on 2 gloo ranks (`_check_each`), in one launch."""
    root = tmp_path_factory.mktemp("two-ranks")
    run_on_ranks(_check_each, 2, {t: str(b) for t, b in bases.items()}, str(root))
    return root


def test_sharded_load_equals_the_base_model_on_two_ranks(base: Path, on_two_ranks: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    out = on_two_ranks / f"{base.parent.name}-full"
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert (out / "model.safetensors.index.json").is_file()
    AutoConfig.from_pretrained(base).save_pretrained(out)  # train writes it at start
    saved = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for key, tensor in AutoModelForCausalLM.from_pretrained(base).state_dict().items():
        assert torch.equal(saved[key], tensor), key


@pytest.fixture
def one_rank() -> Any:
    """A real one-rank gloo process group in this process (destroyed after the test)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_reaches_fully_shard(
    base: Path, one_rank: Any, reshard: bool
) -> None:
    """false (Axolotl's SHARD_GRAD_OP) keeps each block's parameters gathered after forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    cfg = _cfg(base, fsdp={"reshard_after_forward": reshard})
    model = build_meta_model(cfg)
    shard_model(model, cfg, init_device_mesh("cpu", (1,)))
    materialize_and_load(model, cfg, torch.device("cpu"), 0)
    block = model.model.layers[0]
    assert isinstance(block.mlp.up_proj.weight, DTensor)  # sharded before forward
    model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.sum()
    assert isinstance(block.mlp.up_proj.weight, DTensor) is reshard


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attn_implementation_reaches_the_model(base: Path, impl: str) -> None:
    model = build_meta_model(_cfg(base, attn_implementation=impl))
    assert model.config._attn_implementation == impl


@pytest.mark.slow
def test_moe_bases_saved_per_expert_train_on_two_ranks_and_merge_to_their_names(
    tmp_path: Path,
) -> None:
    """Mixtral, Qwen3-MoE and DeepSeek-V2 as save_pretrained stores them (per-expert
    `experts.0.down_proj.weight`; Mixtral's under `block_sparse_moe.experts.0.w1`) load as
    from_pretrained loads them (fused at load), train 2 steps on 2 gloo ranks in one launch,
    and the merged model has the base model's key names and loads in transformers."""
    from click.testing import CliRunner
    from safetensors import safe_open
    from train_helpers import train_configs, write_config
    from transformers import AutoModelForCausalLM

    from helpers.tiny import MOE_TYPES, tiny_texts, write_jsonl
    from shardforge.cli.main import cli

    write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in tiny_texts(24, seed=1)])
    runs = []
    for kind in MOE_TYPES:
        make_model(tmp_path / kind / "base", kind)
        cfg = {
            "base_model": str(tmp_path / kind / "base"),
            "output_dir": str(tmp_path / kind / "out"),
            "datasets": [{"path": str(tmp_path / "data.jsonl"), "type": "completion"}],
            "sequence_len": 32,
            "micro_batch_size": 2,
            "max_steps": 2,
            "learning_rate": 1e-3,
        }
        runs.append((str(write_config(tmp_path / f"{kind}.yml", cfg)), None))
    (tmp_path / "stores").mkdir()
    run_on_ranks(train_configs, 2, runs, str(tmp_path / "stores"))
    for kind in MOE_TYPES:
        merged = tmp_path / kind / "merged"
        args = ["merge-sharded-fsdp-weights", str(tmp_path / f"{kind}.yml")]
        result = CliRunner().invoke(cli, [*args, "--output_path", str(merged), "--quiet"])
        assert result.exit_code == 0, (kind, result.output)

        def names(folder: Path) -> set[str]:
            with safe_open(str(folder / "model.safetensors"), "pt") as f:
                return set(f.keys())

        assert names(merged) == names(tmp_path / kind / "base"), kind
        assert any(".experts.0." in n for n in names(merged)), kind
        trained = AutoModelForCausalLM.from_pretrained(merged)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / kind / "base")
        changed = [
            k
            for k, v in trained.state_dict().items()
            if "experts" in k and not torch.equal(v, base.state_dict()[k])
        ]
        assert changed, kind  # the experts were trained, not left at their initial values
