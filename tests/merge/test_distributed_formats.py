"""Every checkpoint of the formats and architectures of issue 22, through the four commands its
"Must show" names: `inspect`, `--verify`, `--remove_checkpoint_dir` and the distributed merge.

The checkpoints are the session-shared ones, written by the real saving APIs on gloo ranks:
accelerate's per-rank `.bin` (a model, and an adapter_only LoRA save), collective-free DCP, DCP
safetensors (sharded, and consolidated as torchtitan leaves it) from `helpers.shared`; FSDP2 +
TP rank files over a 2x2 mesh from `helpers.meshes`; fused MoE experts, FP8 weights with an
int64 buffer, and MXFP4-packed experts from `helpers.moe` (saved under other names than they
have in memory: the converted groups of `keymap.converted`).

For each, one test: a copy is inspected, then merged on one process with `--verify` and
`--remove_checkpoint_dir` (the output holds the tensors the model was saved from; the model
shard files are gone, nothing else); the same merge on 2 gloo ranks (`merge_on_ranks`, every
checkpoint in one launch of 2 processes) is byte for byte the single-process output.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from helpers.meshes import mesh_rank_files
from helpers.moe import moe_checkpoints
from helpers.outputs import output_files
from helpers.preloaded import run_on_preloaded_ranks
from helpers.shared import saved_formats
from helpers.tiny import make_tokenizer
from shardforge.inspection import inspect_checkpoint
from shardforge.io.copy import ReadCache
from shardforge.keymap.converted import written_together
from shardforge.merge.api import merge_fsdp_weights
from shardforge.merge.distributed import assign, create_files, shares, write_shares

pytestmark = pytest.mark.slow  # gloo ranks write the checkpoints and run the merges

OK = "ok"


@dataclass(frozen=True)
class Case:
    root: str  # "saved", "mesh" or "moe": which shared folder
    base: str  # the base model (config, tokenizer; a LoRA adapter's base weights)
    checkpoint: str
    storage: str  # what `inspect` says, with the world size and the tensor count
    world: int
    tensors: int
    expected: str  # the model the checkpoint was saved from ("peft:ADAPTER": base + adapter)
    left: tuple[str, ...] = ()  # what stays in the checkpoint folder after the removal
    merge_lora: bool = False


CASES = {
    "accelerate-bin": Case(
        "saved", "base", "accelerate/checkpoint_1", "accelerate-bin", 2, 21,
        "trained/model.safetensors", ("optimizer_0_rank0.bin", "optimizer_0_rank1.bin"),
    ),
    "accelerate-adapter-only": Case(
        "saved", "base", "accelerate-lora/checkpoint_1", "accelerate-bin", 2, 8,
        "peft:lora-expected", ("adapter_config.json",), merge_lora=True,
    ),
    "collective-free-dcp": Case(
        "saved", "base", "collective-free/checkpoint-2", "dcp-ranks", 2, 21,
        "trained/model.safetensors",
    ),
    "dcp-safetensors-sharded": Case(
        "saved", "base", "hf-sharded", "dcp-safetensors", 2, 21, "trained/model.safetensors"
    ),
    "dcp-safetensors-consolidated": Case(
        "saved", "base", "titan/step-4", "dcp-safetensors", 2, 21, "trained/model.safetensors"
    ),
    "fsdp-tp-2x2": Case("mesh", "base", "tp", "rank-files", 4, 21, "base/model.safetensors"),
    "moe-fused-experts": Case(
        "moe", "qwen3_moe/base", "qwen3_moe/model", "dcp", 2, 25,
        "qwen3_moe/base/model.safetensors",
    ),
    "fp8-int-buffer": Case(
        "moe", "fp8/base", "fp8/model", "dcp", 2, 76, "fp8/base/model.safetensors"
    ),
    "mxfp4": Case("moe", "mxfp4/base", "mxfp4/model", "dcp", 2, 41, "mxfp4/base/model.safetensors"),
}  # fmt: skip


Job = tuple[dict[str, str], dict[str, Any]]  # (config, merge options)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "saved": saved_formats(tmp_path_factory),
        "mesh": mesh_rank_files(tmp_path_factory),
        "moe": moe_checkpoints(tmp_path_factory),
    }


def _job(roots: dict[str, Path], case: Case) -> Job:
    root = roots[case.root]
    cfg = {"base_model": str(root / case.base), "output_dir": str(root)}
    return cfg, {"checkpoint": str(root / case.checkpoint), "merge_lora": case.merge_lora}


def _step(run: Path, step: int) -> Path:
    """`run/checkpoint-STEP/`, a step of our layout (its model/ is the caller's)."""
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"format": "shardforge", "step": step}))
    return folder


@pytest.fixture(scope="module")
def built_here(roots: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """Merges built here (no ranks: tiny DCP saves in this process). Two whose outputs share
    one value computed in memory (`written_together`), and a refused one:

    - converter: hrm_text, saved with gate and up (and q, k, v) concatenated: transformers'
      reversed converter runs on the real tensors (a `ConvertedSource` group per module);
    - averaged-experts: the fused-experts checkpoint averaged with a copy of itself: the
      average is computed in memory, and each expert is a slice of it (`SliceSource`s read
      whole, a group per fused tensor);
    - lora-of-fused-experts: LoRA factors of the fused-experts architecture (with
      --merge_lora), which no merge maps yet: refused on every rank.
    """
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("in-memory-groups")
    config = AutoConfig.for_model(
        "hrm_text", hidden_size=32, intermediate_size=32, num_attention_heads=4, vocab_size=320
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "hrm-base")
    make_tokenizer(320).save_pretrained(root / "hrm-base")
    dcp.save(model.state_dict(), checkpoint_id=_step(root / "hrm", 1) / "model", no_dist=True)
    fused = roots["moe"] / "qwen3_moe"
    for step in (1, 2):
        shutil.copytree(fused / "model", _step(root / "averaged", step) / "model")
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj"
    factors = {
        f"{q_proj}.lora_A.weight": torch.ones(4, 64),
        f"{q_proj}.lora_B.weight": torch.ones(64, 4),
    }
    dcp.save(factors, checkpoint_id=_step(root / "lora", 1) / "model", no_dist=True)
    return {
        "converter": ({"base_model": str(root / "hrm-base"), "output_dir": str(root / "hrm")}, {}),
        "averaged-experts": (
            {"base_model": str(fused / "base"), "output_dir": str(root / "averaged")},
            {"average_steps": (1, 2)},
        ),
        "lora-of-fused-experts": (
            {"base_model": str(fused / "base"), "output_dir": str(root / "lora")},
            {"merge_lora": True},
        ),
    }


def _merge_all(rank: int, world: int, jobs: dict[str, Job], out: str) -> None:
    """On each rank: every job merged on the ranks (`group=`), its outcome in a file."""
    import torch.distributed as dist

    for name, (cfg, options) in jobs.items():
        try:
            merge_fsdp_weights(
                cfg, Path(out) / name, verify=True, quiet=True, group=dist.group.WORLD, **options
            )
            outcome = OK
        except Exception:
            outcome = traceback.format_exc()
        (Path(out) / f"{name}.{rank}.result").write_text(outcome)


@pytest.fixture(scope="module")
def on_two_ranks(
    roots: dict[str, Path],
    built_here: dict[str, Job],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """Every case and group merged with --verify on 2 gloo ranks, in one launch."""
    out = tmp_path_factory.mktemp("two-ranks")
    jobs = {name: _job(roots, case) for name, case in CASES.items()} | built_here
    run_on_preloaded_ranks(_merge_all, 2, jobs, str(out))  # imported once, not per rank
    return out


def _two_ranks_wrote(on_two_ranks: Path, name: str, single: Path) -> None:
    for rank in (0, 1):
        assert (on_two_ranks / f"{name}.{rank}.result").read_text() == OK
    assert _tree(on_two_ranks / name) == _tree(single)


def _tree(root: Path) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in output_files(root).items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _expected(root: Path, expected: str, base: Path) -> dict[str, torch.Tensor]:
    if not expected.startswith("peft:"):
        return load_file(root / expected)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    fused = PeftModel.from_pretrained(model, root / expected.removeprefix("peft:"))
    return dict(fused.merge_and_unload().state_dict())


@pytest.mark.parametrize("name", list(CASES))
def test_inspect_verify_removal_and_two_ranks(
    roots: dict[str, Path], on_two_ranks: Path, tmp_path: Path, name: str
) -> None:
    case = CASES[name]
    root = roots[case.root]
    copy = Path(shutil.copytree(root / case.checkpoint, tmp_path / "run" / "checkpoint"))
    facts = inspect_checkpoint(copy)
    assert (facts.contents.storage, facts.contents.world_size, len(facts.tensors)) == (
        case.storage,
        case.world,
        case.tensors,
    )
    cfg, options = _job(roots, case)
    options |= {"checkpoint": copy, "verify": True, "remove_checkpoint_dir": True}
    out = merge_fsdp_weights(cfg, tmp_path / "one", quiet=True, **options)
    left = sorted(p.name for p in copy.iterdir()) if copy.exists() else []
    assert tuple(left) == case.left
    got = load_file(out / "model.safetensors")
    want = _expected(root, case.expected, root / case.base)
    if case.expected.startswith("peft:"):  # PEFT's state dict holds the tied lm_head too
        assert set(got) <= set(want) and len(got) >= len(want) - 1
    else:
        assert sorted(got) == sorted(want)
    assert all(torch.equal(_bits(got[k]), _bits(want[k])) for k in got)
    _two_ranks_wrote(on_two_ranks, name, out)


@pytest.mark.parametrize("name", ["converter", "averaged-experts"])
def test_outputs_made_in_memory_on_two_ranks(
    built_here: dict[str, Job], on_two_ranks: Path, tmp_path: Path, name: str
) -> None:
    """Outputs computed together in memory (`written_together`: one rank writes each group)
    come out of 2 ranks as out of one process."""
    cfg, options = built_here[name]
    prep = _prepared(cfg, options)
    with ReadCache() as reader:
        together = written_together(prep.by_name, reader)
    assert len(set(together.values())) >= 4  # the merge has such groups
    where: dict[int, set[int]] = {}  # group -> the ranks writing it, each output whole
    for rank, mine in enumerate(assign(prep.plan, 2, together)):
        for s in mine:
            if s.tensor.spec.name in together:
                assert s.rows == (0, s.tensor.spec.shape[0]), s
                where.setdefault(together[s.tensor.spec.name], set()).add(rank)
    assert where.keys() == set(together.values())
    assert all(len(ranks) == 1 for ranks in where.values())
    assert {r for ranks in where.values() for r in ranks} == {0, 1}
    out = merge_fsdp_weights(cfg, tmp_path / "one", quiet=True, **options)
    _two_ranks_wrote(on_two_ranks, name, out)


def _prepared(cfg: dict[str, str], options: dict[str, Any]) -> Any:
    from shardforge.config import coerce_cfg
    from shardforge.merge.prepare import prepare
    from shardforge.merge.request import MergeRequest

    return prepare(coerce_cfg(cfg, command="merge"), MergeRequest(Path("unused"), **options))


def _held(prep: Any) -> list[str]:
    """The outputs whose shared in-memory value is still held."""
    return [
        n
        for n, s in prep.by_name.items()
        if getattr(getattr(s, "shared", None), "value", None) is not None
    ]


def _simulated(
    cfg: dict[str, str], options: dict[str, Any], out: Path, world: int, grouped: bool
) -> list[str]:
    """Every rank's shares written to `out` in this process, each rank with its own prepared
    sources (as on its own process); the outputs whose value a rank still holds after them."""
    out.mkdir()
    create_files(_prepared(cfg, options).plan, out)
    held = []
    for rank in range(world):
        prep = _prepared(cfg, options)
        with ReadCache() as reader:
            together = written_together(prep.by_name, reader) if grouped else None
        mine = shares(prep.plan, rank, world, together)
        write_shares(mine, prep.by_name, out, lambda n: None)
        held += _held(prep)
    return held


@pytest.mark.parametrize("name", ["converter", "averaged-experts"])
def test_each_rank_drops_every_value_it_computed(
    built_here: dict[str, Job], tmp_path: Path, name: str
) -> None:
    """The shares of 2 and 3 ranks, written in this process: the files are the single-process
    merge's, and no rank keeps a group's value after its shares. (Cut by bytes alone, a group
    of several outputs split between ranks leaves its value held on each.)"""
    cfg, options = built_here[name]
    single = merge_fsdp_weights(cfg, tmp_path / "one", quiet=True, **options)
    plan = _prepared(cfg, options).plan
    for world in (2, 3):
        out = tmp_path / f"ranks{world}"
        assert not _simulated(cfg, options, out, world, grouped=True), world
        for f in plan.files:
            assert (out / f.name).read_bytes() == (single / f.name).read_bytes()
    if name == "averaged-experts":  # (the converter's groups have one output each)
        cut = [_simulated(cfg, options, tmp_path / f"cut{w}", w, grouped=False) for w in (2, 3)]
        assert any(cut)


def test_a_lora_checkpoint_of_fused_experts_is_refused_on_every_rank(on_two_ranks: Path) -> None:
    """LoRA checkpoints of architectures saved under other names are not merged on one rank
    either (docs/merge.md): every rank stops with that one error, nothing is written."""
    for rank in (0, 1):
        outcome = (on_two_ranks / f"lora-of-fused-experts.{rank}.result").read_text()
        assert "the distributed merge failed on rank 0" in outcome, outcome
        assert "its LoRA checkpoints are not merged" in outcome, outcome
    assert not (on_two_ranks / "lora-of-fused-experts").exists()
