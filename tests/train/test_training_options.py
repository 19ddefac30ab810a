"""Axolotl's training options (issue 34 item 7), each shown changing what training does: the
trainable parameters, the loss, the dtypes, the rows of the embeddings. In this process, on a
one-rank gloo group: a `Trainer` set up as a rank of `shardforge train` sets it up (data,
model built, sharded and loaded, optimizer), then stepped or measured directly."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.tiny import make_model
from shardforge.config import validate_cfg
from shardforge.errors import ConfigError, ShardforgeError
from shardforge.train.runtime import Runtime
from shardforge.train.step import loss_sum

CPU = torch.device("cpu")
QAT = {"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 32}


def _trainer(base_cfg: dict[str, Any], tmp_path: Path, **changes: Any) -> Any:
    """A Trainer set up on the one-rank group (nothing trained yet)."""
    from shardforge.train.loop import Trainer

    cfg = {**base_cfg, "output_dir": str(tmp_path / "out"), "save_steps": None, **changes}
    trainer = Trainer(validate_cfg(cfg), Runtime(0, 1, 0, CPU))
    assert trainer.setup()
    return trainer


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _loss(trainer: Any, rows: int = 4) -> float:
    with torch.no_grad():
        return float(loss_sum(trainer.model, trainer.seqs.select(list(range(rows))), CPU))


@pytest.mark.usefixtures("one_rank_group")
def test_unfrozen_parameters_train_only_the_matching_parameters_and_rows(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    """A block with a trained MLP and frozen attention (mixed requires_grad in one FSDP2
    unit), and the embedding's rows from 100 on: one step changes exactly those."""
    patterns = ["^model.layers.1.mlp.", "^model.embed_tokens.weight$[100:]"]
    # no warmup: its first step has lr 0 (Axolotl's default warmup since issue 34)
    trainer = _trainer(base_cfg, tmp_path, unfrozen_parameters=patterns, warmup_steps=0)
    model = trainer.model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"model.layers.1.mlp.{m}_proj.weight" for m in ("gate", "up", "down")} | {
        "model.embed_tokens.weight"
    }
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == 4
    assert bool((trainer.seqs.input_ids < 100).any())  # rows below 100 do get gradients
    before = _full(model)
    trainer.step()
    after = _full(model)
    for name in before:
        changed = not torch.equal(before[name], after[name])
        assert changed == (name in trained), name
    embed = "model.embed_tokens.weight"
    assert torch.equal(before[embed][:100], after[embed][:100])  # frozen rows
    assert not torch.equal(before[embed][100:], after[embed][100:])


def test_unfrozen_parameters_refuses_what_matches_nothing(tmp_path: Path) -> None:
    from shardforge.train.freeze import freeze_except

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="unfrozen_parameters: no parameter name matches"):
        freeze_except(model, ["^nothing"])
    with pytest.raises(ConfigError, match=r"unfrozen_parameters\[0\]: 'weight\[3:1\]'"):
        freeze_except(model, ["weight[3:1]"])


@pytest.mark.usefixtures("one_rank_group")
def test_qat_fake_quantizes_the_forward_and_keeps_plain_names(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    """qat: the same weights give another loss (fake-quantized int4 weights, int8
    activations); the parameters keep their names (checkpoints and merges are a plain model);
    fake_quant_after_n_steps: the plain loss until that step."""
    from shardforge.train.options import QatDelay
    from shardforge.train.precision import fake_quantizers

    plain = _trainer(base_cfg, tmp_path / "plain")
    qat = _trainer(base_cfg, tmp_path / "qat", qat=QAT)
    # weights and activations of every linear layer: 7 per block and the output layer
    assert len(fake_quantizers(qat.model)) == (2 * 7 + 1) * 2
    assert [n for n, _ in qat.model.named_parameters()] == [
        n for n, _ in plain.model.named_parameters()
    ]
    assert _loss(qat) != pytest.approx(_loss(plain), rel=1e-4)
    delayed = _trainer(base_cfg, tmp_path / "d", qat={**QAT, "fake_quant_after_n_steps": 1})
    assert any(isinstance(c, QatDelay) for c in delayed.callbacks)
    assert _loss(delayed) == pytest.approx(_loss(plain), rel=1e-6)
    delayed.global_step = 1
    for callback in delayed.callbacks:
        if isinstance(callback, QatDelay):
            callback.on_step(delayed, {})
    assert _loss(delayed) == pytest.approx(_loss(qat), rel=1e-6)


@pytest.mark.usefixtures("one_rank_group")
def test_qat_keeps_tied_embeddings_tied_and_the_final_save_loads(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    """qat on a model that ties its input embedding and output layer (Qwen3's
    tie_word_embeddings, as the qwen3 8b-qat example): the fake-quantized output layer keeps
    the embedding's parameter (torchao's swap on the meta device made it one of its own, which
    trained them apart and made the final save refuse them), with quantize_embedding too; a
    step trains the one matrix, the final FULL_STATE_DICT save stores it once and loads."""
    from transformers import AutoModelForCausalLM

    base = make_model(tmp_path / "tied", "qwen3", tie_word_embeddings=True)
    fsdp = {"transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]}
    fsdp["state_dict_type"] = "FULL_STATE_DICT"  # type: ignore[assignment]
    for quantize_embedding in (False, True):
        out = tmp_path / f"run-{quantize_embedding}"
        qat = {**QAT, "quantize_embedding": quantize_embedding}
        trainer = _trainer(
            {**base_cfg, "base_model": str(base), "fsdp": fsdp}, out, qat=qat, max_steps=1
        )
        model = trainer.model
        assert hasattr(model.lm_head, "weight_fake_quantizer")
        assert model.lm_head.weight is model.model.embed_tokens.weight
        trainer.step()
        assert trainer.final
        trainer.save()
        saved = AutoModelForCausalLM.from_pretrained(out / "out")
        assert saved.lm_head.weight is saved.model.embed_tokens.weight
        trained = model.model.embed_tokens.weight.full_tensor().detach()
        assert torch.equal(saved.model.embed_tokens.weight.detach(), trained)


def test_qat_refuses_what_axolotl_refuses() -> None:
    with pytest.raises(ValueError, match="weight_dtype int8 with activation_dtype None"):
        validate_cfg({"base_model": "m", "qat": {"weight_dtype": "int8"}})
    cfg = validate_cfg(
        {"base_model": "m", "qat": {"weight_dtype": "fp8", "activation_dtype": "float8"}}
    )
    assert cfg.qat is not None and cfg.qat.weight_dtype == "float8_e4m3fn"


@pytest.mark.usefixtures("one_rank_group")
def test_bfloat16_weights_and_fp32_norms(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    """bfloat16: the weights (so the optimizer's state) are bfloat16; fp32_norms: the norm
    layers keep float32 weights and compute in float32 under bf16 mixed precision, their
    output in bfloat16."""
    trainer = _trainer(base_cfg, tmp_path, bfloat16=True, bf16=True, fp32_norms=True)
    dtypes = {n: p.dtype for n, p in trainer.model.named_parameters()}
    assert {d for n, d in dtypes.items() if "norm" not in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if "norm" in n} == {torch.float32}
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    norm = trainer.model.model.layers[0].input_layernorm
    norm.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    _loss(trainer)
    assert seen and seen[0] == (torch.float32, torch.bfloat16)
    plain = _trainer(base_cfg, tmp_path / "plain", bf16=True)
    assert {p.dtype for p in plain.model.parameters()} == {torch.float32}


@pytest.mark.usefixtures("one_rank_group")
def test_neftune_adds_noise_in_training_only(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    plain = _trainer(base_cfg, tmp_path / "plain")
    noisy = _trainer(base_cfg, tmp_path / "noisy", neftune_noise_alpha=50.0)
    assert _loss(noisy) != pytest.approx(_loss(plain), rel=1e-4)  # train mode: noise
    noisy.model.eval()
    plain.model.eval()
    assert _loss(noisy) == pytest.approx(_loss(plain), rel=1e-6)


@pytest.mark.usefixtures("one_rank_group")
def test_full_determinism(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        _trainer(base_cfg, tmp_path, full_determinism=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_model_kwargs_set_config_attributes_and_the_weight_dtype(base_cfg: dict[str, Any]) -> None:
    from shardforge.train.model import load_model_config
    from shardforge.train.precision import weight_dtype

    for key in ("model_kwargs", "overrides_of_model_kwargs"):
        cfg = validate_cfg(
            {**base_cfg, key: {"rms_norm_eps": 0.5, "torch_dtype": "bfloat16"}}, command="train"
        )
        assert load_model_config(cfg).rms_norm_eps == 0.5
        assert weight_dtype(cfg) == torch.bfloat16
    cfg = validate_cfg({**base_cfg, "model_kwargs": {"no_such_option": 1}}, command="train")
    with pytest.raises(ConfigError, match=r"model_kwargs\.no_such_option: not an attribute"):
        load_model_config(cfg)


def test_vocab_size_rounded_to_32_or_shrunk(base_cfg: dict[str, Any]) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from shardforge.train.vocab import grow_vocab_size

    tokenizer = AutoTokenizer.from_pretrained(base_cfg["base_model"])
    tokenizer.add_tokens(["<x1>", "<x2>", "<x3>"])  # 323 tokens

    def size(vocab: int, **keys: Any) -> int:
        config = AutoConfig.from_pretrained(base_cfg["base_model"], vocab_size=vocab)
        return grow_vocab_size(config, tokenizer, validate_cfg({**base_cfg, **keys}))

    assert size(320) == 323
    assert size(320, resize_token_embeddings_to_32x=True) == 352
    assert size(400) == 400  # a larger vocabulary is kept
    assert size(400, shrink_embeddings=True) == 323
    assert size(400, shrink_embeddings=True, resize_token_embeddings_to_32x=True) == 352


@pytest.mark.usefixtures("one_rank_group")
def test_shrink_embeddings_cuts_the_rows(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    base = make_model(tmp_path / "wide", "llama", vocab_size=352, seed=5, with_tokenizer=False)
    tokenizer = base_cfg["base_model"]  # 320 tokens
    trainer = _trainer(
        base_cfg, tmp_path, base_model=str(base), tokenizer_config=tokenizer, shrink_embeddings=True
    )
    stored = load_file(str(base / "model.safetensors"))
    got = _full(trainer.model)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(got[key], stored[key][:320])
    assert trainer.model_config.vocab_size == 320


@pytest.mark.usefixtures("one_rank_group")
def test_mean_resizing_embeddings_false_draws_new_rows(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    added = {"tokens": ["<x1>", "<x2>"]}
    mean = _full(_trainer(base_cfg, tmp_path / "m", **added).model)["model.embed_tokens.weight"]
    drawn = _full(_trainer(base_cfg, tmp_path / "n", **added, mean_resizing_embeddings=False).model)
    rows = drawn["model.embed_tokens.weight"]
    assert torch.equal(rows[:320], mean[:320])
    assert torch.allclose(mean[320:], mean[:320].mean(0).expand(2, -1))
    assert not torch.allclose(rows[320:], mean[320:])
    assert 0.01 < float(rows[320:].std()) < 0.04  # N(0, initializer_range 0.02)


@pytest.mark.usefixtures("one_rank_group")
def test_fix_untrained_tokens_gives_the_mean(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    """Rows 5 and 7 never trained (zero in the base): `[5]` sets row 5 (input and output) to
    the mean of the trained rows and leaves row 7; `true` fixes those the data holds."""
    from safetensors.torch import load_file, save_file

    base = make_model(tmp_path / "base", "llama", vocab_size=320, seed=0)
    weights = load_file(str(base / "model.safetensors"))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[key][[5, 7]] = 0.0
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    trainer = _trainer(base_cfg, tmp_path, base_model=str(base), fix_untrained_tokens=[5])
    got = _full(trainer.model)
    untrained = weights["model.embed_tokens.weight"].amax(dim=1) <= 1e-16  # 5, 7, the pad row
    assert untrained[[5, 7]].all()
    trained = (~untrained).nonzero().flatten()
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.allclose(got[key][5], weights[key][trained].mean(0), atol=1e-6)
        assert not got[key][7].any()
    in_data = set(trainer.seqs.input_ids.unique().tolist())
    every = _trainer(base_cfg, tmp_path / "all", base_model=str(base), fix_untrained_tokens=True)
    row7 = _full(every.model)["model.embed_tokens.weight"][7]
    assert bool(row7.any()) == (7 in in_data)


def _float8_stand_in(
    module: torch.nn.Module,
    *,
    module_filter_fn: Any = None,
    config: Any = None,
) -> torch.nn.Module:
    """torchao 0.18's convert_to_float8_training, by signature: records what it is asked."""
    _float8_stand_in.calls.append(  # type: ignore[attr-defined]
        {
            "converted": [n for n, m in module.named_modules() if module_filter_fn(m, n)],
            "all_gather": config.enable_fsdp_float8_all_gather,
        }
    )
    return module


def test_fp8_converts_the_linear_layers_on_a_float8_gpu(
    base_cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path against a stand-in with torchao 0.18's signature (a GPU of compute
    capability 9.0 pretended); here, on CPU, fp8 is one error line."""
    import torchao.float8

    from shardforge.train.model import build_meta_model
    from shardforge.train.options import before_shard as apply_fp8

    def shape(fn: Any) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(torchao.float8.convert_to_float8_training) == shape(_float8_stand_in)
    cfg = validate_cfg({**base_cfg, "fp8": True, "fp8_enable_fsdp_float8_all_gather": True})
    model = build_meta_model(cfg)
    with pytest.raises(ConfigError, match=r"^fp8: float8 training needs a CUDA GPU"):
        apply_fp8(model, cfg)
    _float8_stand_in.calls = []  # type: ignore[attr-defined]
    monkeypatch.setattr(torchao.float8, "convert_to_float8_training", _float8_stand_in)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    apply_fp8(model, cfg)
    (call,) = _float8_stand_in.calls  # type: ignore[attr-defined]
    assert call["all_gather"] is True
    assert "lm_head" not in call["converted"]
    assert len(call["converted"]) == 2 * 7  # q, k, v, o, gate, up, down of both blocks


@pytest.mark.usefixtures("one_rank_group")
def test_dataloader_drop_last_trains_whole_batches_per_epoch(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    keys = {"max_steps": None, "num_epochs": 2, "micro_batch_size": 5}  # global batch 10
    plain = _trainer(base_cfg, tmp_path / "p", **keys)
    dropped = _trainer(base_cfg, tmp_path / "d", **keys, dataloader_drop_last=True)
    n, batch = len(plain.seqs), plain.global_batch
    assert n % batch  # a partial last batch
    assert plain.total_steps == -(-2 * n // batch)
    assert dropped.total_steps == 2 * (n // batch)
    used = n // batch * batch
    # the second epoch starts right after the last whole batch of the first
    assert dropped.order.indices(used, batch) == plain.order.indices(n, batch)


@pytest.mark.usefixtures("one_rank_group")
def test_data_smaller_than_one_global_batch_trains_as_axolotl_does(
    base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fewer sequences than one global batch: Axolotl trains (at least one step); so does
    `train`, each step's batch filled from the next passes of the data order. With
    dataloader_drop_last there is no whole batch: one error naming the key."""
    from shardforge.train.data import rank_slice

    keys = {
        "max_steps": None,
        "num_epochs": 1,
        "micro_batch_size": 500,
        "gradient_accumulation_steps": 1,
    }
    with caplog.at_level(logging.WARNING, logger="shardforge"):
        trainer = _trainer(base_cfg, tmp_path / "p", **keys)
    n, batch = len(trainer.seqs), trainer.global_batch
    assert n < batch and trainer.total_steps == 1
    assert "fewer than one global batch (500 = " in caplog.text
    start, count = rank_slice(0, 0, 0, 1, 500)
    drawn = trainer.order.indices(start, count)
    assert sorted(set(drawn)) == list(range(n)) and drawn[:n] != drawn[n : 2 * n]
    with pytest.raises(ShardforgeError, match=r"datasets: \d+ sequences .*dataloader_drop_last"):
        _trainer(base_cfg, tmp_path / "d", **keys, dataloader_drop_last=True)


@pytest.mark.usefixtures("one_rank_group")
def test_qat_before_lora(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    """With a LoRA adapter, the base layers are fake-quantized, the adapter's own are not (as
    Axolotl: QAT before the adapter)."""
    from train_helpers import LORA

    from shardforge.train.precision import fake_quantizers

    trainer = _trainer(base_cfg, tmp_path, qat={**QAT, "activation_dtype": None}, **LORA)
    names = [n for n, m in trainer.model.named_modules() if hasattr(m, "weight_fake_quantizer")]
    assert names and not [n for n in names if "lora_" in n]
    assert any(n.endswith("q_proj.base_layer") for n in names)
    assert len(fake_quantizers(trainer.model)) == 2 * 7 + 1


def test_fp32_norm_classes_pick_the_norm_modules() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from shardforge.train.precision import is_fp32_norm

    norm = LlamaRMSNorm(8)
    for classes, picked in ((None, True), (["LayerNorm"], False), (["LlamaRMSNorm"], True)):
        cfg = validate_cfg({"base_model": "m", "fp32_norms": True, "fp32_norm_classes": classes})
        assert is_fp32_norm(norm, cfg) is picked, classes
    qualified = f"{LlamaRMSNorm.__module__}.LlamaRMSNorm"
    cfg = validate_cfg({"base_model": "m", "fp32_norms": True, "fp32_norm_classes": [qualified]})
    assert is_fp32_norm(norm, cfg)


class _Saver:
    keep: frozenset[Any] = frozenset()


class _Trainer:
    """What BestModel reads of the loop's Trainer: a checkpoint every 2 steps."""

    def __init__(self, **keys: Any) -> None:
        self.cfg = validate_cfg({"base_model": "m", "val_set_size": 0.1, **keys})
        self.rt = Runtime(0, 1, 0, CPU)
        self.saver, self.stop, self.global_step, self.total_steps = _Saver(), False, 0, 10

    @property
    def final(self) -> bool:
        return self.stop or self.global_step >= self.total_steps

    def save_due(self) -> bool:
        return self.global_step % 2 == 0


def _best_of(records: list[dict[str, float]], **keys: Any) -> tuple[Any, Any]:
    from shardforge.train.best import BestModel

    trainer = _Trainer(**keys)
    best = BestModel(trainer)
    for step, record in enumerate(records, start=1):
        trainer.global_step = step
        best.on_evaluate(trainer, {"step": step, **record})
        if trainer.stop:
            break
    return best, trainer


def test_metric_for_best_model_and_greater_is_better() -> None:
    """Early stopping follows metric_for_best_model (perplexity here falls while the loss
    rises) and greater_is_better (a larger loss is the better one)."""
    losses = [{"eval_loss": v, "eval_perplexity": 10 - v} for v in (3.0, 2.0, 4.0, 5.0, 1.0)]
    best, trainer = _best_of(losses, early_stopping_patience=1)
    assert trainer.global_step == 3 and trainer.stop  # loss: 2.0 at step 2, then worse
    perplexity = {"early_stopping_patience": 1, "metric_for_best_model": "perplexity"}
    best, trainer = _best_of(losses, **perplexity, greater_is_better=False)
    assert trainer.global_step == 2 and trainer.stop  # perplexity 8.0 after 7.0: worse
    best, trainer = _best_of(losses, **perplexity)  # null: larger is better (no "loss" in it)
    assert trainer.global_step == 3 and trainer.stop  # 7.0, 8.0, then 6.0
    best, trainer = _best_of(losses, early_stopping_patience=2, greater_is_better=True)
    assert best.best == 5.0 and not trainer.stop  # a larger loss counts as better
    with pytest.raises(ConfigError, match="metric_for_best_model: eval_accuracy is not"):
        _best_of(losses, early_stopping_patience=1, metric_for_best_model="accuracy")
