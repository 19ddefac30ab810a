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

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.metadata import METADATA_FILE, CheckpointMetadata, read_metadata
from shardforge.formats.lightning_meta import read_lightning_meta
from shardforge.keymap.keys import is_optimizer_key
from shardforge.layouts.steps import (
    LAST,
    OPTIMIZER_DIRS,
    STEP_LAYOUTS,
    TRAINING_STATE_ROOTS,
    Candidate,
    find_candidates,
    has_rank_files,
    kind_of,
    resolve_checkpoint,
)

log = logging.getLogger("shardforge")

CONFIG_SUFFIXES: tuple[str, ...] = (".yml", ".yaml")
DISTCP_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
# per-rank optimizer / extra state files written beside the model rank files (verl); never read
RANK_STATE_FILES: dict[str, re.Pattern[str]] = {
    "optimizer": re.compile(r"^optim_world_size_(\d+)_rank_(\d+)\.pt$"),
    "other": re.compile(r"^extra_state_world_size_(\d+)_rank_(\d+)\.pt$"),
}
# top-level DCP keys that are training state but not optimizer state (torchtitan)
OTHER_STATE_ROOTS: frozenset[str] = TRAINING_STATE_ROOTS
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
class TensorFact:
    """One model tensor: its checkpoint key, dtype, global shape, element and byte counts."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int


@dataclass(frozen=True)
class StepFact:
    """One complete checkpoint found under the searched root."""

    step: int | None  # None: unknown, or Lightning's last.ckpt
    step_label: str  # the step as shown: "200", "last", "?"
    layout: str
    path: str


@dataclass(frozen=True)
class StateSummary:
    """Optimizer (or other training) state: where it is and how much.

    `tensor_count` and `total_bytes` come from metadata (None for files that are not read);
    `files_bytes` is the size on disk of the files that hold it (None when mixed in with the
    model).
    """

    location: str  # "beside" (own DCP dir), "mixed" (same DCP), "files" (per-rank files)
    path: str
    tensor_count: int | None
    non_tensor_count: int | None
    total_bytes: int | None
    files: int
    files_bytes: int | None


@dataclass(frozen=True)
class Contents:
    """What a reader found in one model directory."""

    storage: str
    tensors: tuple[TensorFact, ...]
    non_tensor_keys: tuple[str, ...]
    world_size: int | None
    world_size_source: str | None
    optimizer: StateSummary | None = None
    other_state: StateSummary | None = None
    versions: dict[str, str] = field(default_factory=dict)


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
        }


def _plain(value: StepFact | StateSummary | None) -> dict[str, Any] | None:
    return None if value is None else dict(value.__dict__)


# ---------------------------------------------------------------------------------------------
# locating the checkpoint


def _is_dcp(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


def _is_checkpoint_file(path: Path) -> bool:
    """A DCP `.metadata` / `__R_N.distcp` or a `model_world_size_W_rank_R.pt` file."""
    from shardforge.formats.rankfiles.rank_file import parse_rank_name

    name = path.name
    return name == METADATA_FILE or bool(DISTCP_FILE.match(name)) or bool(parse_rank_name(path))


def _is_step_folder(path: Path) -> bool:
    """A step folder of a known layout (checkpoint-N, global_step_N, step-N)."""
    return any(rule.pattern.match(path.name) for rule in STEP_LAYOUTS.values())


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
    if model_dir.suffix == ".ckpt" or _is_step_folder(model_dir):
        roots.append(model_dir.parent)  # Lightning, torchtitan step-N/, rank files in step_N/
    if _is_step_folder(model_dir.parent):
        roots.append(model_dir.parent.parent)  # checkpoint-N/model, global_step_N/actor
    target = model_dir.resolve()
    for root in roots:
        try:
            cands = find_candidates(root, dirname)
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
    single = kind_of(r) is not None if r.is_dir() and state_dict_dirname is None else False
    # errors (missing, empty, optimizer directory, nothing found) are the merge's own
    chosen = resolve_checkpoint(r, None if single else step, state_dict_dirname)
    if single:
        return _single(chosen, step, state_dict_dirname)
    cands = find_candidates(r, state_dict_dirname)
    if not cands:  # a step folder
        return _single(chosen, step, state_dict_dirname)
    return chosen, cands


# ---------------------------------------------------------------------------------------------
# reading one model directory


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _summary(meta: CheckpointMetadata, keys: list[str], location: str) -> StateSummary | None:
    if not keys:
        return None
    tensors = [meta.tensors[k] for k in keys if k in meta.tensors]
    return StateSummary(
        location=location,
        path=str(meta.directory),
        tensor_count=len(tensors),
        non_tensor_count=sum(1 for k in keys if k not in meta.tensors),
        total_bytes=sum(t.nbytes for t in tensors),
        files=0,
        files_bytes=None,
    )


def _kind(path: tuple[str, ...]) -> str:
    """ "optimizer", "other" (training state that is neither) or "model"."""
    if is_optimizer_key(path):
        return "optimizer"
    first = path[0].split(".", 1)[0] if path else ""
    return "other" if first in OTHER_STATE_ROOTS else "model"


def _distcp_ranks(directory: Path) -> set[int]:
    return {int(m.group(1)) for p in directory.iterdir() if (m := DISTCP_FILE.match(p.name))}


def _beside_optimizer(model_dir: Path) -> StateSummary | None:
    """The optimizer DCP directory next to the model one (`optimizer/`, `optimizer_0/`)."""
    for opt_name, model_names in OPTIMIZER_DIRS.items():
        opt = model_dir.parent / opt_name
        if model_dir.name not in model_names or not _is_dcp(opt):
            continue
        try:
            meta = read_metadata(opt)
        except CheckpointError as exc:
            log.warning("optimizer state not read: %s", exc)
            continue
        keys = [*meta.tensors, *meta.non_tensor_keys]
        summary = _summary(meta, keys, "beside")
        if summary is None:
            continue
        files = [p for p in opt.iterdir() if DISTCP_FILE.match(p.name)]
        return StateSummary(
            **{
                **summary.__dict__,
                "files": len(files),
                "files_bytes": sum(p.stat().st_size for p in files),
            }
        )
    return None


def read_dcp(model_dir: Path) -> Contents:
    """Tensors of a DCP directory by kind; optimizer state mixed in or in its own directory."""
    meta = read_metadata(model_dir)
    by_kind: dict[str, list[str]] = {"model": [], "optimizer": [], "other": []}
    for key, entry in meta.tensors.items():
        by_kind[_kind(entry.path)].append(key)
    model_non_tensor = []
    for key in meta.non_tensor_keys:
        kind = _kind((key,))
        if kind == "model":
            model_non_tensor.append(key)
        else:
            by_kind[kind].append(key)
    tensors = tuple(
        TensorFact(k, _dtype_name(e.dtype), e.shape, e.numel, e.nbytes)
        for k in by_kind["model"]
        for e in (meta.tensors[k],)
    )
    ranks = _distcp_ranks(model_dir)
    optimizer = _summary(meta, by_kind["optimizer"], "mixed") or _beside_optimizer(model_dir)
    versions: dict[str, str] = {}
    if meta.version:
        versions["dcp_metadata"] = meta.version
    return Contents(
        storage="dcp",
        tensors=tensors,
        non_tensor_keys=tuple(model_non_tensor),
        world_size=len(ranks) if ranks else None,
        world_size_source="__R_N.distcp file names" if ranks else None,
        optimizer=optimizer,
        other_state=_summary(meta, by_kind["other"], "mixed"),
        versions=versions,
    )


def _rank_state(rank_dir: Path, kind: str) -> StateSummary | None:
    pattern = RANK_STATE_FILES[kind]
    files = [p for p in sorted(rank_dir.iterdir()) if pattern.match(p.name) and p.is_file()]
    if not files:
        return None
    return StateSummary(
        location="files",
        path=str(rank_dir),
        tensor_count=None,
        non_tensor_count=None,
        total_bytes=None,
        files=len(files),
        files_bytes=sum(p.stat().st_size for p in files),
    )


def read_rank_dir(rank_dir: Path) -> Contents:
    """Tensors of a folder of `model_world_size_W_rank_R.pt` files (metadata only); optimizer
    files beside them are counted, not read."""
    from shardforge.formats.rankfiles import plan_rank_files
    from shardforge.formats.rankfiles.rank_file import parse_rank_name

    plan = plan_rank_files(rank_dir)
    world_sizes = {names[0] for p in rank_dir.iterdir() if (names := parse_rank_name(p))}
    tensors = tuple(
        TensorFact(k, _dtype_name(tp.dtype), tp.shape, tp.numel, tp.nbytes)
        for k, tp in plan.items()
    )
    return Contents(
        storage="rank-files",
        tensors=tensors,
        non_tensor_keys=(),
        world_size=next(iter(world_sizes)) if len(world_sizes) == 1 else None,
        world_size_source="model_world_size_W_rank_R.pt file names",
        optimizer=_rank_state(rank_dir, "optimizer"),
        other_state=_rank_state(rank_dir, "other"),
    )


# storage kind -> (recognise a model directory, read it); adding a storage is adding a row
READERS: dict[str, tuple[Callable[[Path], bool], Callable[[Path], Contents]]] = {
    "dcp": (_is_dcp, read_dcp),
    "rank-files": (has_rank_files, read_rank_dir),
}


def read_contents(model_dir: Path) -> Contents:
    for recognise, read in READERS.values():
        if recognise(model_dir):
            return read(model_dir)
    raise CheckpointError(
        f"{model_dir}: neither a DCP directory (.metadata) nor a folder of "
        "model_world_size_<W>_rank_<R>.pt files"
    )


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
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            log.warning("%s: not read (%s)", p, exc)
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
    if _is_step_folder(model_dir.parent):
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


def inspect_path_or_config(
    path_or_config: str | Path,
    step: int | None = None,
    override_args: list[str] | None = None,
    state_dict_dirname: str | None = None,
) -> Inspection:
    """`inspect_checkpoint` of a checkpoint path, or of a YAML config's `output_dir`."""
    if not is_config_path(path_or_config):
        if override_args:
            raise CheckpointError(
                f"unexpected arguments {' '.join(override_args)}: config overrides need a YAML "
                "config, not a checkpoint path"
            )
        return inspect_checkpoint(path_or_config, step, state_dict_dirname)
    from shardforge.config import load_cfg, parse_override_args

    cfg_path = Path(path_or_config)
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: config file does not exist")
    cfg = load_cfg(cfg_path, command="inspect", **parse_override_args(override_args or []))
    out_dir = Path(str(cfg.output_dir))
    if not out_dir.exists():
        raise CheckpointError(
            f"{cfg_path}: output_dir {out_dir} does not exist; train first, or give the "
            "checkpoint directory instead of the config"
        )
    return inspect_checkpoint(out_dir, step, state_dict_dirname, source=str(cfg_path))
