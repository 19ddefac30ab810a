"""Which tensors --dtype casts: the rules one by one, then a real DCP checkpoint (an int
buffer, an FP8 weight, a `_keep_in_fp32_modules` module) merged by every engine and
described by the dry run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from helpers.keep import FP8_WEIGHT, INT_BUFFER, KEPT, make_keep_checkpoint
from shardforge.errors import MergeError
from shardforge.io.dtypes import DtypeName
from shardforge.merge.api import merge_fsdp_weights
from shardforge.sinks.cast import (
    WHY_ASKED,
    WHY_CONFIG,
    WHY_NONE,
    WHY_RECORDED,
    CastRules,
    as_json,
    cast_rules,
    choose_target,
    decide,
    decide_all,
    describe,
    keep_pattern,
    model_keep_patterns,
    parse_dtype_name,
    target_line,
)

BF16 = torch.bfloat16


def test_each_rule_in_order() -> None:
    rules = cast_rules(BF16, keep=["norm", "layers.*.gate"])
    cases = {
        ("a.weight", torch.float32): (BF16, "cast"),
        ("a.weight", torch.float16): (BF16, "cast"),
        ("a.weight", BF16): (BF16, "same"),
        ("steps", torch.int64): (torch.int64, "integer"),
        ("codes", torch.uint8): (torch.uint8, "integer"),  # packed MXFP4 blocks
        ("mask", torch.bool): (torch.bool, "bool"),
        ("w", torch.float8_e4m3fn): (torch.float8_e4m3fn, "fp8"),
        ("w", torch.float8_e5m2): (torch.float8_e5m2, "fp8"),
        ("w", torch.float8_e8m0fnu): (torch.float8_e8m0fnu, "fp8"),  # MX scales
        ("c", torch.complex64): (torch.complex64, "other"),
        ("model.norm.weight", torch.float32): (torch.float32, "keep"),
        ("model.layers.3.mlp.gate.weight", torch.float32): (torch.float32, "keep"),
        ("model.layers.3.mlp.up.weight", torch.float32): (BF16, "cast"),
    }
    for (name, saved), (dtype, rule) in cases.items():
        d = decide(name, saved, rules)
        assert (d.dtype, d.rule) == (dtype, rule), (name, saved)
    # an FP8 or int tensor a keep pattern also names: its own rule comes first
    assert decide("norm.codes", torch.int8, rules).rule == "integer"
    # no target: everything as stored
    assert {decide("a", t, CastRules(None)).rule for t in (torch.float32, torch.int8)} == {
        "as_saved"
    }


def test_the_scales_of_quantized_weights_are_kept_with_them() -> None:
    """FP8 weights keep their float32 `weight_scale_inv`; MXFP4 blocks and scales are uint8."""
    tensors = [
        ("layers.0.mlp.down_proj.weight", torch.float8_e4m3fn),
        ("layers.0.mlp.down_proj.weight_scale_inv", torch.float32),
        ("layers.0.mlp.experts.down_proj_blocks", torch.uint8),
        ("layers.0.mlp.experts.down_proj_scales", torch.uint8),
        ("layers.0.mlp.up_proj.weight", torch.float32),
        ("layers.0.mlp.up_proj.weight_scale_inv", torch.float32),  # no FP8 weight: a tensor
    ]
    decided = decide_all(tensors, cast_rules(BF16))
    assert [d.rule for d in decided.values()] == [
        "fp8", "scale", "integer", "integer", "cast", "cast"
    ]  # fmt: skip
    assert decided["layers.0.mlp.down_proj.weight_scale_inv"].dtype == torch.float32
    assert (
        "kept: the scales of FP8/FP4 and MXFP4 weights: 1 tensor "
        "(layers.0.mlp.down_proj.weight_scale_inv)"
    ) in describe(decided)


def test_the_output_dtype_is_asked_else_recorded_by_train_else_the_configs() -> None:
    """--dtype wins (as_saved too); without it the base dtype train recorded, then the
    config's; a recorded value that names no floating dtype is passed over."""
    assert choose_target("float32", "bfloat16", "float16") == ("float32", WHY_ASKED)
    assert choose_target(None, "bfloat16", "float16") == (None, WHY_ASKED)
    assert choose_target("config", "bfloat16", "float32") == ("bfloat16", WHY_RECORDED)
    assert choose_target("config", "torch.float16", None) == ("float16", WHY_RECORDED)
    assert choose_target("config", "int64", "float32") == ("float32", WHY_CONFIG)
    assert choose_target("config", None, None) == (None, WHY_NONE)
    line = target_line("bfloat16", WHY_RECORDED)
    assert line == "output dtype: bfloat16 (the base model's stored dtype, recorded by train)"
    assert target_line(None, WHY_ASKED) == "output dtype: as stored (--dtype)"


def test_rules_work_before_torch_on_dtype_names() -> None:
    """The early copy's guess decides on `DtypeName`s, with the same outcome."""
    f32, bf16 = DtypeName("float32", 4, True), DtypeName("bfloat16", 2, True)
    fp8, i64 = DtypeName("float8_e4m3fn", 1, True), DtypeName("int64", 8, False)
    rules = cast_rules(bf16, keep=["router"])
    assert decide("x", f32, rules).dtype == bf16
    assert decide("x", fp8, rules).dtype == fp8
    assert decide("x", i64, rules).dtype == i64
    assert decide("router.weight", f32, rules).dtype == f32


def test_describe_one_line_per_rule_with_counts_and_examples() -> None:
    rules = cast_rules(BF16, keep=["norm"])
    names = [(f"layers.{i}.w", torch.float32) for i in range(5)]
    names += [("norm", torch.float32), ("ids", torch.int64), ("q", torch.float8_e5m2)]
    decisions = decide_all(names, rules)
    lines = describe(decisions)
    assert (
        lines[0] == "cast float32 -> bfloat16: 5 tensors (layers.0.w, layers.1.w, layers.2.w, ...)"
    )
    assert "kept: integer tensors are never cast: 1 tensor (ids)" in lines
    assert "kept: --keep_dtype 'norm': 1 tensor (norm)" in lines
    assert any(line.startswith("kept: FP8/FP4") and "(q)" in line for line in lines)
    assert len(lines) == 4
    assert as_json(decisions)["norm"] == {
        "saved": "float32",
        "dtype": "float32",
        "rule": "kept: --keep_dtype 'norm'",
    }


def test_bad_patterns_and_dtype_names_are_one_line_errors() -> None:
    with pytest.raises(MergeError, match=r"--keep_dtype '\(': not a pattern"):
        keep_pattern("(")
    with pytest.raises(MergeError, match="--dtype 'int8': expected one of"):
        parse_dtype_name("int8")
    assert parse_dtype_name("BF16") == "bfloat16" and parse_dtype_name(None) == "config"


def test_model_lists_are_matched_as_the_installed_transformers_matches_them() -> None:
    """transformers 5 searches every name for each glob: `router` matches wherever it is."""
    from transformers.core_model_loading import build_glob_alternation

    class Model:
        _keep_in_fp32_modules = ("router",)
        _keep_in_fp32_modules_strict = ("gate.weight", "e_score_correction_bias")

    patterns = model_keep_patterns(Model())
    assert [str(p) for p in patterns] == [
        "Model._keep_in_fp32_modules 'router'",
        "Model._keep_in_fp32_modules_strict 'e_score_correction_bias'",
        "Model._keep_in_fp32_modules_strict 'gate.weight'",
    ]
    names = [
        "model.layers.0.mlp.router.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "lm_head.weight",
    ]
    theirs = build_glob_alternation(sorted({"router", "e_score_correction_bias", "gate.weight"}))[0]
    for name in names:
        ours = any(p.matches(name) for p in patterns)
        assert ours == (theirs.search(name) is not None), name


# ----------------------------------------------------------------- a real checkpoint, merged


@pytest.fixture(scope="module")
def keep_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("keep")
    base, ckpt = make_keep_checkpoint(root)
    return base, ckpt, torch.load(root / "state.pt", weights_only=True)


def _stored(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize("engine", ["stream", "transformers"])
def test_dtype_bfloat16_casts_only_the_other_floats(
    keep_ckpt: tuple[Path, Path, dict[str, Any]], engine: str, tmp_path: Path
) -> None:
    base, ckpt, saved = keep_ckpt
    cfg = {"base_model": str(base), "output_dir": str(tmp_path / "run")}
    out = merge_fsdp_weights(
        cfg,
        tmp_path / "merged",
        checkpoint=ckpt,
        dtype="bfloat16",
        engine=engine,
        save_tokenizer=False,
        verify=True,
        quiet=True,
    )
    got = _stored(out)
    assert got.keys() == saved.keys()
    assert got[FP8_WEIGHT].dtype == torch.float8_e4m3fn  # FP8: byte for byte
    assert torch.equal(_bits(got[FP8_WEIGHT]), _bits(saved[FP8_WEIGHT]))
    assert got[INT_BUFFER].dtype == torch.int64 and torch.equal(got[INT_BUFFER], saved[INT_BUFFER])
    assert got[KEPT].dtype == torch.float32 and torch.equal(got[KEPT], saved[KEPT])
    cast = [n for n in saved if n not in (FP8_WEIGHT, INT_BUFFER, KEPT)]
    assert len(cast) > 10
    for name in cast:
        assert got[name].dtype == BF16, name
        assert torch.equal(got[name], saved[name].to(BF16)), name


def test_keep_dtype_keeps_more_and_the_dry_run_says_why(
    keep_ckpt: tuple[Path, Path, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    base, ckpt, saved = keep_ckpt
    cfg = {"base_model": str(base), "output_dir": str(tmp_path / "run")}
    options: dict[str, Any] = {"checkpoint": ckpt, "dtype": "bf16", "keep_dtype": ["norm"]}
    merge_fsdp_weights(cfg, tmp_path / "plan", dry_run=True, **options)
    text = capsys.readouterr().out
    assert not (tmp_path / "plan").exists()
    assert "\noutput dtype: bfloat16 (--dtype)\ndtypes: " in text
    rules = text[text.index("dtype rules:") :].splitlines()[1:6]
    norms = [n for n in saved if "norm" in n]
    cast = len(saved) - len(norms) - 3
    assert rules[0].startswith(f"  cast float32 -> bfloat16: {cast} tensors (")
    assert f"  kept: --keep_dtype 'norm': {len(norms)} tensors (" in "\n".join(rules)
    assert f"  kept: integer tensors are never cast: 1 tensor ({INT_BUFFER})" in rules
    assert any(r.startswith("  kept: FP8/FP4") and f"({FP8_WEIGHT})" in r for r in rules)
    kept = "  kept: TinyKeepForCausalLM._keep_in_fp32_modules 'router': 1 tensor (router.weight)"
    assert kept in rules
    out = merge_fsdp_weights(cfg, tmp_path / "merged", quiet=True, save_tokenizer=False, **options)
    got = _stored(out)
    assert {got[n].dtype for n in norms} == {torch.float32}
    assert sum(t.dtype == BF16 for t in got.values()) == cast
