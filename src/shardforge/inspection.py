"""What a sharded checkpoint holds, read from its metadata alone: layout, steps, world size,
writer versions, model tensors, optimizer contents.

    from shardforge.inspection import inspect_checkpoint
    facts = inspect_checkpoint("outputs/run")          # or a config, a step or a DCP directory
    facts.parameter_count, facts.to_dict()             # a JSON-able dict

Nothing is written and nothing is unpickled outside the existing allow-list readers
(`formats.dcp.metadata` for DCP, `formats.rankfiles` for per-rank DTensor files; Lightning's `meta.pt`
through the allow-list unpickler, `formats.lightning_meta`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardforge.errors import CheckpointError
from shardforge.formats.base import Contents, StateSummary, TensorFact
from shardforge.formats.dcp.format import DISTCP_FILE, state_summary
from shardforge.formats.dcp.metadata import METADATA_FILE, read_metadata
from shardforge.formats.lightning_meta import read_lightning_meta
from shardforge.formats.rankfiles.names import parse_rank_name
from shardforge.formats.registry import detect, looked_for
from shardforge.io.copy import fact_session
from shardforge.io.files import check_size, read_json
from shardforge.io.mirror import mirrored
from shardforge.io.remote import is_remote
from shardforge.layouts.catalog import resolve_checkpoint, scan
from shardforge.layouts.layout import LAST, OPTIMIZER_DIRS, Candidate, format_of, is_step_folder
from shardforge.sinks.cast import (
    Decision,
    as_json,
    cast_rules,
    config_dtype_name,
    decide_all,
    describe,
    model_keep_patterns,
    parse_dtype_name,
)

log = logging.getLogger("shardforge")

CONFIG_SUFFIXES: tuple[str, ...] = (".yml", ".yaml")
# JSON files in or beside a model directory that may record versions and the world size:
# shardforge's trainer_state.json, verl's fsdp_config.json and huggingface/config.json
STATE_JSON_FILES: tuple[str, ...] = (
    "trainer_state.json",
    "fsdp_config.json",
    "huggingface/config.json",
)
# `*_version` keys of those files that version the file's own format, not a writer
NOT_WRITER_VERSIONS: frozenset[str] = frozenset({"format_version"})
LIGHTNING_META = "meta.pt"


@dataclass(frozen=True)
class StepFact:
    """One complete checkpoint found under the searched root."""

    step: int | None  # None: unknown, or Lightning's last.ckpt
    step_label: str  # the step as shown: "200", "last", "?"
    layout: str
    path: str


@dataclass(frozen=True)
class Inspection:
    """Everything `shardforge inspect` reports about one checkpoint."""

    source: str
    layout: str
    step: int | None
    step_label: str
    model_dir: str
    key_names: str  # "hugging-face", or the adapter the merge maps them with ("torchtitan")
    steps: tuple[StepFact, ...]
    contents: Contents
    # what an output dtype would cast and keep (`with_casts`; None: not asked)
    casts: Mapping[str, Decision] | None = None
    cast_target: str | None = None

    @property
    def tensors(self) -> tuple[TensorFact, ...]:
        return self.contents.tensors

    @property
    def parameter_count(self) -> int:
        return sum(t.numel for t in self.contents.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.contents.tensors)

    def dtype_bytes(self) -> dict[str, int]:
        """Model bytes per dtype, largest first."""
        out: dict[str, int] = {}
        for t in self.contents.tensors:
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description (the document `inspect --json` prints)."""
        c = self.contents
        return {
            "source": self.source,
            "layout": self.layout,
            "storage": c.storage,
            "step": self.step,
            "step_label": self.step_label,
            "model_dir": self.model_dir,
            "key_names": self.key_names,
            "steps": [_plain(s) for s in self.steps],
            "world_size": c.world_size,
            "world_size_source": c.world_size_source,
            "versions": dict(c.versions),
            "model": {
                "tensor_count": len(c.tensors),
                "parameter_count": self.parameter_count,
                "total_bytes": self.total_bytes,
                "bytes_by_dtype": self.dtype_bytes(),
                "tensors": [
                    {
                        "name": t.name,
                        "dtype": t.dtype,
                        "shape": list(t.shape),
                        "numel": t.numel,
                        "bytes": t.nbytes,
                    }
                    for t in c.tensors
                ],
            },
            "non_tensor_keys": list(c.non_tensor_keys),
            "optimizer": _plain(c.optimizer),
            "other_state": _plain(c.other_state),
            **({} if self.casts is None else {"dtype_rules": self._dtype_rules()}),
        }

    def _dtype_rules(self) -> dict[str, Any]:
        assert self.casts is not None
        return {
            "target": self.cast_target,
            "rules": describe(self.casts),
            "tensors": as_json(self.casts),
        }


def _plain(value: StepFact | StateSummary | None) -> dict[str, Any] | None:
    return None if value is None else dict(value.__dict__)


# ---------------------------------------------------------------------------------------------
# locating the checkpoint


def _is_dcp(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


def _is_checkpoint_file(path: Path) -> bool:
    """A DCP `.metadata` / `__R_N.distcp` or a `model_world_size_W_rank_R.pt` file."""
    name = path.name
    return name == METADATA_FILE or bool(DISTCP_FILE.match(name)) or bool(parse_rank_name(path))


def _step_fact(c: Candidate) -> StepFact:
    if c.step == LAST:
        return StepFact(None, "last", c.layout, str(c.model_dir))
    if c.step < 0:
        return StepFact(None, "?", c.layout, str(c.model_dir))
    return StepFact(c.step, str(c.step), c.layout, str(c.model_dir))


def _identify(
    model_dir: Path, dirname: str | None
) -> tuple[Candidate, list[Candidate], Path] | None:
    """(candidate, its siblings, root) of a model directory given directly, found from the
    folder of a Lightning `*.ckpt` or a step folder, or the run folder above a step folder;
    None when it belongs to no known layout."""
    roots = []
    if model_dir.suffix == ".ckpt" or is_step_folder(model_dir):
        roots.append(model_dir.parent)  # Lightning, torchtitan step-N/, rank files in step_N/
    if is_step_folder(model_dir.parent):
        roots.append(model_dir.parent.parent)  # checkpoint-N/model, global_step_N/actor
    target = model_dir.resolve()
    for root in roots:
        try:
            cands = list(scan(root, dirname).candidates)
        except (OSError, CheckpointError):
            continue
        for c in cands:
            if c.model_dir.resolve() == target:
                return c, cands, root
    return None


def _single(
    chosen: Candidate, step: int | None, dirname: str | None
) -> tuple[Candidate, list[Candidate]]:
    """A single checkpoint (given directly, or a step folder): its layout and step when the
    folder around it tells, and the other steps there."""
    known = _identify(chosen.model_dir, dirname)
    if known is None:
        if step is not None:
            log.warning("--step %d ignored: %s is a single checkpoint", step, chosen.model_dir)
        return chosen, []
    found, cands, root = known
    if step is not None and found.step != step:
        raise CheckpointError(
            f"{chosen.model_dir}: is the checkpoint of step {found.step}, not {step}; give the "
            f"run folder {root} to choose a step"
        )
    return found, cands


def locate(
    path: str | Path, step: int | None = None, state_dict_dirname: str | None = None
) -> tuple[Candidate, list[Candidate]]:
    """(the checkpoint to describe, every complete checkpoint found beside it).

    `path` is a checkpoint root (the latest, or `step`, chosen as the merge chooses), a step
    folder, a DCP directory or a folder of per-rank files; `state_dict_dirname` names the
    model folder inside each step (e.g. pytorch_ema_model_fsdp_0).
    """
    r = Path(path)
    if r.is_file() and _is_checkpoint_file(r):
        r = r.parent  # one file of a checkpoint stands for its folder
    if r.exists() and not r.is_dir():
        raise CheckpointError(
            f"{r}: not a directory; give a checkpoint directory or a YAML config (.yml/.yaml)"
        )
    single = format_of(r) is not None if r.is_dir() and state_dict_dirname is None else False
    # errors (missing, empty, optimizer directory, nothing found) are the merge's own
    chosen = resolve_checkpoint(r, None if single else step, state_dict_dirname)
    if single:
        return _single(chosen, step, state_dict_dirname)
    cands = list(scan(r, state_dict_dirname).candidates)
    if not cands:  # a step folder
        return _single(chosen, step, state_dict_dirname)
    return chosen, cands


# ---------------------------------------------------------------------------------------------
# reading one model directory


def _beside_optimizer(model_dir: Path) -> StateSummary | None:
    """The optimizer DCP directory next to the model one (`optimizer/`, `optimizer_0/`)."""
    for opt_name, model_names in OPTIMIZER_DIRS.items():
        opt = model_dir.parent / opt_name
        if model_dir.name not in model_names or not (opt / METADATA_FILE).is_file():
            continue
        try:
            meta = read_metadata(opt)
        except CheckpointError as exc:
            log.warning("optimizer state not read: %s", exc)
            continue
        summary = state_summary(meta, [*meta.tensors, *meta.non_tensor_keys], "beside")
        if summary is None:
            continue
        files = [p for p in opt.iterdir() if DISTCP_FILE.match(p.name)]
        return replace(summary, files=len(files), files_bytes=sum(p.stat().st_size for p in files))
    return None


def read_contents(model_dir: Path) -> Contents:
    """What the folder's format describes, with the optimizer state the layout keeps beside it."""
    fmt = detect(model_dir)
    if fmt is None:
        looked = [f"- {what}" for what in looked_for()]
        raise CheckpointError(f"{model_dir}: not a sharded checkpoint; looked for:", looked)
    contents = fmt.describe(model_dir)
    if contents.optimizer is None:
        contents = replace(contents, optimizer=_beside_optimizer(model_dir))
    return contents


# ---------------------------------------------------------------------------------------------
# what the writer recorded beside the weights


def _recorded_json(directory: Path) -> dict[str, Any]:
    """`*_version` values and the world size from the JSON files of `STATE_JSON_FILES` in
    `directory`; unreadable files are skipped with a warning."""
    out: dict[str, Any] = {}
    for name in STATE_JSON_FILES:
        p = directory / name
        if not p.is_file():
            continue
        try:
            data = read_json(p)  # its size capped before it is read
        except CheckpointError as exc:
            log.warning("not read: %s", exc)
            continue
        if not isinstance(data, dict):
            continue
        for key, value in data.items():
            if key in NOT_WRITER_VERSIONS:
                continue
            if key.endswith("_version") and isinstance(value, str | int) and str(value):
                out.setdefault("versions", {})[key.removesuffix("_version")] = str(value)
        ws = data.get("world_size")
        if isinstance(ws, int) and not isinstance(ws, bool) and ws > 0 and "world_size" not in out:
            out["world_size"] = (ws, name)
    return out


def _lightning_versions(ckpt_dir: Path) -> dict[str, str]:
    """`*_version` strings of a Lightning `meta.pt`, read through the allow-list unpickler."""
    meta_pt = ckpt_dir / LIGHTNING_META
    if not meta_pt.is_file():
        return {}
    try:
        meta = read_lightning_meta(meta_pt)
    except CheckpointError as exc:  # the allow-list refused it, or it is damaged: report nothing
        log.info("%s: not read (%s)", meta_pt, str(exc).removeprefix(f"{meta_pt}: ")[:200])
        return {}
    return {
        str(k).removesuffix("_version"): v
        for k, v in meta.items()
        if str(k).endswith("_version") and isinstance(v, str)
    }


def _with_recorded(contents: Contents, model_dir: Path) -> Contents:
    recorded: dict[str, Any] = {}
    # the step folder around a model folder (checkpoint-N/model) holds the trainer's state;
    # above a folder given on its own, files belong to something else
    folders = [model_dir]
    if is_step_folder(model_dir.parent):
        folders.append(model_dir.parent)
    for d in folders:
        for key, value in _recorded_json(d).items():
            if key == "versions":
                recorded.setdefault("versions", {}).update(value)
            else:
                recorded.setdefault(key, value)
    versions = {**recorded.get("versions", {}), **_lightning_versions(model_dir)}
    versions.update(contents.versions)
    world_size, source = contents.world_size, contents.world_size_source
    if "world_size" in recorded:
        world_size, name = recorded["world_size"]
        source = name
    return Contents(
        **{
            **contents.__dict__,
            "versions": versions,
            "world_size": world_size,
            "world_size_source": source,
        }
    )


# ---------------------------------------------------------------------------------------------


def inspect_checkpoint(
    path: str | Path,
    step: int | None = None,
    state_dict_dirname: str | None = None,
    *,
    source: str | None = None,
) -> Inspection:
    """Describe the checkpoint at `path` (the latest under it, or `step`; the model folder
    `state_dict_dirname` inside each step when given) without writing or loading any weights;
    CheckpointError when there is none or it is unreadable."""
    with fact_session():  # the folder is scanned, its .metadata read, once
        chosen, cands = locate(path, step, state_dict_dirname)
        contents = _with_recorded(read_contents(chosen.model_dir), chosen.model_dir)
    fact = _step_fact(chosen)
    return Inspection(
        source=source if source is not None else str(path),
        layout=chosen.layout,
        step=fact.step,
        step_label=fact.step_label,
        model_dir=str(chosen.model_dir),
        key_names=chosen.adapter or "hugging-face",
        steps=tuple(_step_fact(c) for c in sorted(cands, key=lambda c: c.step)),
        contents=contents,
    )


def is_config_path(path: str | Path) -> bool:
    p = Path(path)
    return p.suffix.lower() in CONFIG_SUFFIXES and not p.is_dir()


def _model_on_meta(source: str, trust_remote_code: bool) -> Any | None:
    """The model of the config at `source` built on the meta device (its class's float32
    lists); None, with a warning, when it cannot be built."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        local = Path(source)  # a local folder's (or file's) config, before transformers reads it
        check_size(local if local.is_file() else local / "config.json")
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:  # the report goes on without the model's own rules
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        log.warning(
            "%s: the model's float32 modules are not known (%s: %s)",
            source,
            type(exc).__name__,
            reason,
        )
        return None


def with_casts(
    facts: Inspection, dtype: str | None, keep: Sequence[str], model: Any | None = None
) -> Inspection:
    """`facts` with what an output dtype (`dtype`; else the model config's, else none) would
    cast and keep of the checkpoint's tensors, by the merge's rules (`sinks.cast`): the
    `--keep_dtype` patterns `keep` and the float32 lists of `model` (built on the meta device)
    matched against the names as the checkpoint stores them."""
    name = parse_dtype_name(dtype)
    if name == "config":
        name = config_dtype_name(getattr(model, "config", None))
    rules = cast_rules(name, keep, model_keep_patterns(model) if model is not None else ())
    casts = decide_all(((t.name, t.dtype) for t in facts.tensors), rules)
    return replace(facts, casts=casts, cast_target=name)


def inspect_path_or_config(
    path_or_config: str | Path,
    step: int | None = None,
    override_args: list[str] | None = None,
    state_dict_dirname: str | None = None,
    dtype: str | None = None,
    keep_dtype: Sequence[str] = (),
) -> Inspection:
    """`inspect_checkpoint` of a checkpoint path, or of a YAML config's `output_dir` (an
    s3:// URI is read through its mirror in the caller's staging area, `io.mirror`); with
    `dtype` or `keep_dtype`, what the merge would cast and keep (`with_casts`; a config's
    base model gives the default dtype and the model's float32 modules)."""
    casts = dtype is not None or bool(keep_dtype)
    if is_remote(str(path_or_config)):
        path_or_config = mirrored(str(path_or_config))
    if not is_config_path(path_or_config):
        if override_args:
            raise CheckpointError(
                f"unexpected arguments {' '.join(override_args)}: config overrides need a YAML "
                "config, not a checkpoint path"
            )
        facts = inspect_checkpoint(path_or_config, step, state_dict_dirname)
        return with_casts(facts, dtype, keep_dtype) if casts else facts
    from shardforge.config import load_cfg, parse_override_args

    cfg_path = Path(path_or_config)
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: config file does not exist")
    cfg = load_cfg(cfg_path, command="inspect", **parse_override_args(override_args or []))
    out_dir = Path(cfg.output_dir)
    if is_remote(cfg.output_dir):
        out_dir = mirrored(cfg.output_dir, cfg.storage_options)
    if not out_dir.exists():
        raise CheckpointError(
            f"{cfg_path}: output_dir {out_dir} does not exist; train first, or give the "
            "checkpoint directory instead of the config"
        )
    facts = inspect_checkpoint(out_dir, step, state_dict_dirname, source=str(cfg_path))
    if not casts:
        return facts
    model = _model_on_meta(cfg.base_model_config or cfg.base_model, cfg.trust_remote_code)
    return with_casts(facts, dtype, keep_dtype, model)
