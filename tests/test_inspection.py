"""`inspect_checkpoint` on real checkpoints written by 3 gloo ranks of a `fully_shard`-ed tiny
Llama after one AdamW step, in four layouts: ours (`checkpoint-N/model` + `optimizer` +
`trainer_state.json`, written by the trainer's own save), HF Trainer (`pytorch_model_fsdp_0` +
`optimizer_0`), Lightning (a `.ckpt/` DCP with model and optimizer mixed, and `meta.pt`) and
verl per-rank files (`global_step_N/actor/model_world_size_3_rank_R.pt`).

The checkpoints are built once per test session, also across xdist workers (a file lock);
the CLI tests use the same ones (`from test_inspection import build_checkpoints`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers.dist import run_on_ranks
from helpers.shared import shared_folder
from helpers.tiny import make_model
from shardforge.errors import CheckpointError
from shardforge.formats.dcp.pickles import load_metadata_pickle
from shardforge.inspection import inspect_checkpoint, inspect_path_or_config

# the checkpoints are written by gloo ranks (build_checkpoints)
pytestmark = pytest.mark.slow

WORLD = 3
OURS_STEPS = (2, 4)
HF_STEP = 7
LIGHTNING_STEP = 5
VERL_STEPS = (1, 3)
TITAN_STEP = 6
LMMS_STEP = 8
EMA_DIR = "pytorch_ema_model_fsdp_0"
LIGHTNING_VERSION = "2.5.0"


def write_checkpoints(rank: int, world_size: int, base: str, root: str) -> None:
    """One AdamW step on a fully_shard-ed model, then every layout under `root`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from shardforge.train.checkpointing import TrainerState, save_checkpoint, stamped

    out = Path(root)
    model = AutoModelForCausalLM.from_pretrained(base)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6]])).logits.float().pow(2).mean().backward()
    optim.step()

    for step in OURS_STEPS:
        state = TrainerState(step, world_size, 0, world_size, OURS_STEPS[-1], 0)
        save_checkpoint(out / "ours", stamped(state), model, optim, None)

    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optim)
    hf = out / "hf" / f"checkpoint-{HF_STEP}"
    dcp.save({"model": model_sd}, checkpoint_id=str(hf / "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": optim_sd}, checkpoint_id=str(hf / "optimizer_0"))

    ckpt = out / "lightning" / "version_0" / "checkpoints" / f"epoch=0-step={LIGHTNING_STEP}.ckpt"
    dcp.save(
        {"model": {f"model.{k}": v for k, v in model_sd.items()}, "optimizer_0": optim_sd},
        checkpoint_id=str(ckpt),
    )

    for step in VERL_STEPS:
        actor = out / "verl" / f"global_step_{step}" / "actor"
        actor.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), actor / f"model_world_size_{world_size}_rank_{rank}.pt")
        torch.save(optim.state_dict(), actor / f"optim_world_size_{world_size}_rank_{rank}.pt")

    # torchtitan: one DCP per step-N/ with the model flat beside the training state
    titan = out / "titan" / f"step-{TITAN_STEP}"
    train_state = {"step": torch.tensor(TITAN_STEP)}
    dcp.save({**model_sd, "optimizer": optim_sd, "train_state": train_state}, checkpoint_id=titan)

    # LMMs-Engine FSDP2 trainer: rank files for the model and for its EMA copy
    for sub in ("pytorch_model_fsdp_0", EMA_DIR):
        folder = out / "lmms" / f"checkpoint-{LMMS_STEP}" / sub
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), folder / f"model_world_size_{world_size}_rank_{rank}.pt")

    if rank == 0:
        (hf / "trainer_state.json").write_text(json.dumps({"global_step": HF_STEP}))
        meta = {"global_step": LIGHTNING_STEP, "epoch": 0}
        torch.save({**meta, "pytorch-lightning_version": LIGHTNING_VERSION}, ckpt / "meta.pt")
        (out / "verl" / "latest_checkpointed_iteration.txt").write_text(str(VERL_STEPS[-1]))


@dataclass(frozen=True)
class Built:
    """The checkpoints and the numbers expected from the model that wrote them."""

    root: Path
    base: Path
    names: tuple[str, ...]
    params: int
    nbytes: int

    @property
    def ours(self) -> Path:
        return self.root / "ours"


def _write_all(root: Path) -> None:
    # vocab 331 and intermediate 101 do not split evenly over 3 ranks
    base = make_model(root / "base", "llama", vocab_size=331, intermediate_size=101)
    run_on_ranks(write_checkpoints, WORLD, str(base), str(root))


def build_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Write the checkpoints once for the whole session (every xdist worker shares them)."""
    root = shared_folder(tmp_path_factory, "inspect-checkpoints", _write_all)
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(root / "base").state_dict()
    return Built(
        root,
        root / "base",
        tuple(sd),
        sum(t.numel() for t in sd.values()),
        sum(t.numel() * t.element_size() for t in sd.values()),
    )


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def test_ours_latest_with_every_fact(checkpoints: Built) -> None:
    before = snapshot(checkpoints.ours)
    facts = inspect_checkpoint(checkpoints.ours)
    assert snapshot(checkpoints.ours) == before  # nothing written, nothing touched
    assert (facts.layout, facts.step, facts.contents.storage) == ("shardforge", 4, "dcp")
    assert facts.model_dir == str(checkpoints.ours / "checkpoint-4" / "model")
    assert [(s.step, s.layout) for s in facts.steps] == [(2, "shardforge"), (4, "shardforge")]
    c = facts.contents
    assert (c.world_size, c.world_size_source) == (WORLD, "trainer_state.json")
    assert c.versions["torch"] == torch.__version__
    assert set(c.versions) >= {"torch", "transformers", "shardforge"}
    raw_version = load_metadata_pickle(Path(facts.model_dir) / ".metadata").version
    assert c.versions["dcp_metadata"] == raw_version
    assert tuple(t.name for t in facts.tensors) == checkpoints.names
    assert facts.parameter_count == checkpoints.params
    assert facts.total_bytes == checkpoints.nbytes
    emb = next(t for t in facts.tensors if t.name == "model.embed_tokens.weight")
    assert (emb.dtype, emb.shape, emb.nbytes) == ("float32", (331, 64), 331 * 64 * 4)
    # AdamW: exp_avg and exp_avg_sq like each parameter, plus a float32 `step` scalar each
    opt = c.optimizer
    assert opt is not None and opt.location == "beside"
    assert opt.path == str(checkpoints.ours / "checkpoint-4" / "optimizer")
    n = len(checkpoints.names)
    assert (opt.tensor_count, opt.total_bytes) == (3 * n, 2 * checkpoints.nbytes + 4 * n)
    assert opt.non_tensor_count and opt.files == WORLD and opt.files_bytes
    assert c.other_state is None and c.non_tensor_keys == ()


def test_json_document_round_trips(checkpoints: Built) -> None:
    doc = json.loads(json.dumps(inspect_checkpoint(checkpoints.ours).to_dict()))
    assert (doc["layout"], doc["step"], doc["world_size"]) == ("shardforge", 4, WORLD)
    assert [s["step"] for s in doc["steps"]] == list(OURS_STEPS)
    model = doc["model"]
    assert model["tensor_count"] == len(model["tensors"]) == len(checkpoints.names)
    assert model["parameter_count"] == checkpoints.params
    assert model["total_bytes"] == checkpoints.nbytes == sum(t["bytes"] for t in model["tensors"])
    assert model["bytes_by_dtype"] == {"float32": checkpoints.nbytes}
    assert doc["optimizer"]["tensor_count"] == 3 * len(checkpoints.names)


def test_step_choice_and_paths_inside_a_run(checkpoints: Built) -> None:
    ours = checkpoints.ours
    assert inspect_checkpoint(ours, step=2).model_dir == str(ours / "checkpoint-2" / "model")
    for inside in (ours / "checkpoint-2", ours / "checkpoint-2" / "model"):
        facts = inspect_checkpoint(inside)
        assert (facts.layout, facts.step) == ("shardforge", 2)
        assert [s.step for s in facts.steps] == list(OURS_STEPS)
        assert facts.parameter_count == checkpoints.params
    with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 3.*\[2, 4\]"):
        inspect_checkpoint(ours, step=3)
    with pytest.raises(CheckpointError, match="step 2, not 4"):
        inspect_checkpoint(ours / "checkpoint-2" / "model", step=4)


def test_hf_trainer_layout_with_optimizer_0(checkpoints: Built) -> None:
    facts = inspect_checkpoint(checkpoints.root / "hf")
    assert (facts.layout, facts.step) == ("hf-trainer", HF_STEP)
    c = facts.contents
    # no versions recorded by the HF Trainer; the world size from the __R_N.distcp names
    assert (c.world_size, c.world_size_source) == (WORLD, "__R_N.distcp file names")
    assert set(c.versions) <= {"dcp_metadata"}
    assert tuple(t.name for t in facts.tensors) == tuple(f"model.{k}" for k in checkpoints.names)
    assert (facts.parameter_count, facts.total_bytes) == (checkpoints.params, checkpoints.nbytes)
    assert c.optimizer is not None and c.optimizer.path.endswith("optimizer_0")
    assert c.optimizer.tensor_count == 3 * len(checkpoints.names)


def test_lightning_optimizer_mixed_in_and_meta_versions(checkpoints: Built) -> None:
    for path in (checkpoints.root / "lightning", *checkpoints.root.glob("lightning/**/*.ckpt")):
        facts = inspect_checkpoint(path)
        assert (facts.layout, facts.step) == ("lightning", LIGHTNING_STEP)
        c = facts.contents
        assert c.versions["pytorch-lightning"] == LIGHTNING_VERSION
        assert c.world_size == WORLD
        names = tuple(t.name for t in facts.tensors)
        assert names == tuple(f"model.model.{k}" for k in checkpoints.names)
        assert facts.parameter_count == checkpoints.params
        opt = c.optimizer
        assert opt is not None and opt.location == "mixed" and opt.files == 0
        n = len(checkpoints.names)
        assert (opt.tensor_count, opt.total_bytes) == (3 * n, 2 * checkpoints.nbytes + 4 * n)


def test_verl_rank_files(checkpoints: Built) -> None:
    verl = checkpoints.root / "verl"
    facts = inspect_checkpoint(verl)
    assert facts.step == VERL_STEPS[-1] and facts.contents.storage == "rank-files"
    assert facts.model_dir == str(verl / f"global_step_{VERL_STEPS[-1]}" / "actor")
    assert [s.step for s in facts.steps] == list(VERL_STEPS)
    c = facts.contents
    assert c.world_size == WORLD and "model_world_size" in str(c.world_size_source)
    assert tuple(t.name for t in facts.tensors) == checkpoints.names
    assert (facts.parameter_count, facts.total_bytes) == (checkpoints.params, checkpoints.nbytes)
    # optimizer rank files are counted, never unpickled
    assert c.optimizer is not None and c.optimizer.location == "files"
    assert (c.optimizer.files, c.optimizer.tensor_count) == (WORLD, None)
    one = inspect_checkpoint(verl, step=VERL_STEPS[0])
    assert one.step == VERL_STEPS[0]
    actor = verl / "global_step_1" / "actor"
    for inside in (actor.parent, actor, actor / f"model_world_size_{WORLD}_rank_1.pt"):
        assert inspect_checkpoint(inside).step == VERL_STEPS[0]
        assert inspect_checkpoint(inside).model_dir == str(actor)


def test_torchtitan_step_with_training_state(checkpoints: Built) -> None:
    for path in (checkpoints.root / "titan", checkpoints.root / "titan" / f"step-{TITAN_STEP}"):
        facts = inspect_checkpoint(path)
        assert (facts.layout, facts.step, facts.key_names) == (
            "torchtitan",
            TITAN_STEP,
            "torchtitan",
        )
        assert tuple(t.name for t in facts.tensors) == checkpoints.names
        c = facts.contents
        assert c.optimizer is not None and c.optimizer.location == "mixed"
        assert c.optimizer.tensor_count == 3 * len(checkpoints.names)
        assert c.other_state is not None and c.other_state.tensor_count == 1
        assert c.other_state.total_bytes == 8  # train_state.step, an int64 scalar


def test_lmms_engine_rank_files_and_ema_folder(checkpoints: Built) -> None:
    lmms = checkpoints.root / "lmms"
    facts = inspect_checkpoint(lmms)
    assert (facts.layout, facts.step, facts.contents.storage) == (
        "lmms-engine",
        LMMS_STEP,
        "rank-files",
    )
    assert facts.model_dir.endswith("pytorch_model_fsdp_0")
    ema = inspect_checkpoint(lmms, state_dict_dirname=EMA_DIR)
    assert ema.model_dir == str(lmms / f"checkpoint-{LMMS_STEP}" / EMA_DIR)
    assert (ema.step, ema.parameter_count) == (LMMS_STEP, checkpoints.params)
    assert ema.contents.world_size == WORLD
    with pytest.raises(CheckpointError, match="state_dict_dirname"):
        inspect_checkpoint(lmms, state_dict_dirname="../elsewhere")


def test_config_searches_output_dir(checkpoints: Built, tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        f"base_model: {checkpoints.base}\noutput_dir: {checkpoints.ours}\n"
        "datasets:\n  - path: data.jsonl\n    type: completion\n"
    )
    facts = inspect_path_or_config(cfg)
    assert (facts.source, facts.step) == (str(cfg), 4)
    assert inspect_path_or_config(cfg, step=2).step == 2
    hf = inspect_path_or_config(cfg, None, ["--output_dir", str(checkpoints.root / "hf")])
    assert hf.layout == "hf-trainer"
    with pytest.raises(CheckpointError, match=r"output_dir .*nope does not exist"):
        inspect_path_or_config(cfg, None, ["--output_dir", str(tmp_path / "nope")])
    with pytest.raises(CheckpointError, match="overrides need a YAML config"):
        inspect_path_or_config(checkpoints.ours, None, ["--output_dir", "x"])


def test_bad_inputs_are_refused_with_one_line(checkpoints: Built, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("x")
    cases = {
        tmp_path / "missing": "does not exist",
        tmp_path / "empty": "empty",
        tmp_path / "notes": "no complete checkpoint found",
        tmp_path / "notes" / "readme.txt": "not a directory",
        checkpoints.ours / "checkpoint-4" / "optimizer": "optimizer checkpoint, not model weights",
    }
    for path, message in cases.items():
        with pytest.raises(CheckpointError, match=message) as info:
            inspect_checkpoint(path)
        assert "\n" not in info.value.message and str(path) in info.value.message
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == []


def test_a_dcp_folder_of_no_known_layout(
    checkpoints: Built, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    alone = tmp_path / "exported" / "weights"
    shutil.copytree(checkpoints.ours / "checkpoint-4" / "model", alone)
    # a trainer_state.json above a folder given on its own is not the checkpoint's
    (alone.parent / "trainer_state.json").write_text('{"world_size": 64, "torch_version": "x"}')
    with caplog.at_level("WARNING", logger="shardforge"):
        facts = inspect_checkpoint(alone, step=2)
    assert "--step 2 ignored" in caplog.text
    assert (facts.layout, facts.step, facts.step_label, facts.steps) == ("dcp", None, "?", ())
    c = facts.contents
    assert (c.world_size, c.world_size_source) == (WORLD, "__R_N.distcp file names")
    assert set(c.versions) == {"dcp_metadata"} and c.optimizer is None
    assert facts.parameter_count == checkpoints.params


def test_a_damaged_checkpoint_names_the_file(checkpoints: Built, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(checkpoints.ours / "checkpoint-4", copy / "checkpoint-4")
    victim = sorted((copy / "checkpoint-4" / "model").glob("__*.distcp"))[-1]
    os.truncate(victim, 10)
    with pytest.raises(CheckpointError, match=f"{victim}: truncated"):
        inspect_checkpoint(copy)
