"""Which tensors an output dtype (`--dtype`) casts, and why each other one keeps its dtype.

One pure function, `decide(name, saved, rules)`, answers for every tensor of every output: the
streaming merge, the merge on several ranks, `--engine transformers` (it loads each tensor in
the planned dtype), merge-lora, the early copy's guess (`merge.overlap`, before torch is
imported: dtypes may be `io.dtypes.DtypeName`s), `--dry_run` and `shardforge inspect`.

    rules = CastRules(torch.bfloat16, keep=(keep_pattern("router", KEEP_OPTION),))
    decide("model.layers.0.mlp.router.weight", torch.float32, rules).dtype   # float32: kept

The target dtype (`choose_target`): ``--dtype`` when given; else the base model's stored dtype
that ``shardforge train`` recorded when the run started (``base_dtype`` in the checkpoint's
trainer_state.json), else the model config's ``dtype`` / ``torch_dtype``, else none. Each
choice comes with its reason, which the merge logs and ``--dry_run`` prints:

    choose_target("config", "bfloat16", "float32")
    # ("bfloat16", "the base model's stored dtype, recorded by train")

The rules, in order (the first that applies decides):

1. no target dtype (``--dtype as_saved``, or none given and neither a recorded base dtype nor
   the config names one): as stored;
2. integer and bool tensors (and complex, quantized): never cast;
3. FP8 / FP4 tensors (`io.dtypes` kinds ``float8`` and ``float4``): kept, since their scales
   are other tensors a cast would not apply (packed MXFP4 blocks are uint8: rule 2); and those
   scales (``weight_scale_inv`` beside an FP8 weight: `keymap.quantized.kept_as_stored`), which
   are floating tensors the weight's values are read with;
4. a name matched by a keep pattern: the model class's ``_keep_in_fp32_modules`` and
   ``_keep_in_fp32_modules_strict`` (matched as the installed transformers matches them when it
   loads a model) and every ``--keep_dtype PATTERN``: kept as stored;
5. stored in the target dtype already: unchanged;
6. every other floating tensor: cast to the target.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from shardforge.errors import MergeError
from shardforge.io.dtypes import DTYPE_NAMES, dtype_info, dtype_name, is_dtype
from shardforge.keymap.quantized import kept_as_stored

# --dtype spellings -> the dtype's name (None: keep each tensor's stored dtype)
DTYPE_CHOICES: dict[str, str | None] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "as_saved": None,
    "as-saved": None,
}
# the model config's attributes naming its dtype, in the order they are read
CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")

KEEP_OPTION = "--keep_dtype"
# the attributes of a transformers model class listing the modules it keeps in float32
MODEL_KEEP_LISTS: tuple[str, ...] = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
# example names shown per rule by `describe`
EXAMPLES = 3

Rule = Literal["as_saved", "integer", "bool", "other", "fp8", "scale", "keep", "same", "cast"]
# what each rule says in --dry_run and inspect (the keep rule names its pattern after it)
RULE_WORDS: dict[str, str] = {
    "cast": "cast",
    "same": "already in the output dtype",
    "as_saved": "as saved (no output dtype)",
    "integer": "kept: integer tensors are never cast",
    "bool": "kept: bool tensors are never cast",
    "other": "kept: not a floating dtype",
    "fp8": "kept: FP8/FP4 weights keep their dtype (their scales are other tensors)",
    "scale": "kept: the scales of FP8/FP4 and MXFP4 weights",
    "keep": "kept",
}


def parse_dtype_name(value: str | None) -> str | Literal["config"] | None:
    """`--dtype` as a dtype name, "config" when not given (torch-free: the merge's head start
    reads it before torch)."""
    if value is None:
        return "config"
    key = value.strip().lower().removeprefix("torch.")
    if key not in DTYPE_CHOICES:
        raise MergeError(f"--dtype {value!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    return DTYPE_CHOICES[key]


def config_dtype_name(config: Any) -> str | None:
    """The name of the model config's floating dtype (`dtype`, else `torch_dtype`), None when
    it names none or a non-floating one (torch-free: a config.json's strings suffice)."""
    raw = next((v for k in CONFIG_DTYPE_KEYS if (v := getattr(config, k, None))), None)
    if isinstance(raw, str):
        return DTYPE_CHOICES.get(raw.lower().removeprefix("torch."))
    if not is_dtype(raw):
        return None
    known = DTYPE_NAMES.get(dtype_name(raw))
    return known.name if known is not None and known.is_floating_point else None


# why the output has its dtype (`choose_target`), as the merge's plan line says it
WHY_ASKED = "--dtype"
WHY_RECORDED = "the base model's stored dtype, recorded by train"
WHY_CONFIG = "the config's dtype"
WHY_NONE = "no --dtype, and the config names no dtype"


def floating_name(value: object) -> str | None:
    """A recorded dtype's name (``"bfloat16"``, ``"torch.float16"``) as a floating dtype name
    of `DTYPE_CHOICES`, None when it names none."""
    if not isinstance(value, str):
        return None
    return DTYPE_CHOICES.get(value.strip().lower().removeprefix("torch."))


def choose_target(
    asked: str | Literal["config"] | None, recorded: str | None, configured: str | None
) -> tuple[str | None, str]:
    """The output dtype's name (None: as stored) and why: `asked` (`parse_dtype_name` of
    ``--dtype``) when given; else `recorded` (the base model's stored dtype that train wrote
    into the checkpoint), else `configured` (the model config's), else none."""
    if asked != "config":
        return asked, WHY_ASKED
    if floating_name(recorded) is not None:
        return floating_name(recorded), WHY_RECORDED
    if configured is not None:
        return configured, WHY_CONFIG
    return None, WHY_NONE


def target_line(name: str | None, why: str) -> str:
    """The merge's plan line for the output dtype: 'output dtype: bfloat16 (--dtype)'."""
    return f"output dtype: {name or 'as stored'} ({why})"


@dataclass(frozen=True)
class KeepPattern:
    """Tensors whose name `regex` finds keep their stored dtype: `text` as given by `origin`
    (``--keep_dtype`` or the model class attribute that lists it)."""

    text: str
    origin: str
    regex: re.Pattern[str]

    def matches(self, name: str) -> bool:
        return self.regex.search(name) is not None

    def __str__(self) -> str:
        return f"{self.origin} {self.text!r}"


def keep_pattern(text: str, origin: str = KEEP_OPTION) -> KeepPattern:
    """A pattern searched in tensor names, as transformers 5 matches `_keep_in_fp32_modules`:
    a regular expression in which ``*`` stands for any characters (``router`` matches every
    name that contains it, ``layers.*.gate`` any layer's gate). A bad one is a MergeError."""
    try:
        return KeepPattern(text, origin, re.compile(text.replace("*", ".*")))
    except re.error as exc:
        raise MergeError(f"{origin} {text!r}: not a pattern ({exc})") from None


@dataclass(frozen=True)
class CastRules:
    """The output dtype of floating tensors (None: as stored) and what keeps its own."""

    target: Any | None  # a torch dtype, a `DtypeName` before torch is imported, or None
    keep: tuple[KeepPattern, ...] = ()

    @property
    def target_name(self) -> str | None:
        return None if self.target is None else dtype_name(self.target)


@dataclass(frozen=True)
class Decision:
    """A tensor's output dtype and the rule that chose it (`keep`: the pattern that matched)."""

    dtype: Any
    rule: Rule
    saved: Any
    keep: KeepPattern | None = None

    @property
    def why(self) -> str:
        """The rule in words: 'cast float32 -> bfloat16', "kept: --keep_dtype 'router'"."""
        if self.rule == "cast":
            return f"cast {dtype_name(self.saved)} -> {dtype_name(self.dtype)}"
        if self.rule == "keep":
            return f"kept: {self.keep}"
        return RULE_WORDS[self.rule]


def decide(name: str, saved: Any, rules: CastRules, scale: bool = False) -> Decision:
    """The output dtype of tensor `name` stored as `saved` (see the module docstring);
    `scale`: it is the scale of a quantized weight (`decide_all` knows from the others)."""
    info = dtype_info(saved)
    if rules.target is None:
        return Decision(saved, "as_saved", saved)
    if info is None or not info.castable:
        kind = None if info is None else info.kind
        rule: Rule = (
            "integer"
            if kind in ("int", "uint")
            else "bool"
            if kind == "bool"
            else "fp8"
            if kind in ("float8", "float4")
            else "other"
        )
        return Decision(saved, rule, saved)
    if scale:
        return Decision(saved, "scale", saved)
    for pattern in rules.keep:
        if pattern.matches(name):
            return Decision(saved, "keep", saved, pattern)
    if dtype_name(saved) == dtype_name(rules.target):
        return Decision(saved, "same", saved)
    return Decision(rules.target, "cast", saved)


def decide_all(tensors: Iterable[tuple[str, Any]], rules: CastRules) -> dict[str, Decision]:
    """`decide` for every (name, stored dtype) of one output, in their order (the scales of
    its quantized weights found among them: `keymap.quantized.kept_as_stored`)."""
    saved = dict(tensors)
    quantized = kept_as_stored(saved)
    return {n: decide(n, d, rules, scale=n in quantized) for n, d in saved.items()}


def describe(decisions: Mapping[str, Decision], examples: int = EXAMPLES) -> list[str]:
    """One line per rule that applied: its words, how many tensors and the first `examples`
    names (cast first, then what was kept, by count)."""
    groups: dict[str, list[str]] = {}
    for name, d in decisions.items():
        groups.setdefault(d.why, []).append(name)
    order = sorted(groups, key=lambda why: (not why.startswith("cast"), -len(groups[why]), why))
    lines = []
    for why in order:
        names = groups[why]
        shown = ", ".join(names[:examples]) + (", ..." if len(names) > examples else "")
        noun = "tensor" if len(names) == 1 else "tensors"
        lines.append(f"{why}: {len(names)} {noun} ({shown})")
    return lines


def as_json(decisions: Mapping[str, Decision]) -> dict[str, dict[str, str]]:
    """Every tensor's stored and output dtype and rule (for `inspect --json`)."""
    return {
        name: {"saved": dtype_name(d.saved), "dtype": dtype_name(d.dtype), "rule": d.why}
        for name, d in decisions.items()
    }


def _glob_regex() -> Callable[[str], re.Pattern[str]]:
    """How the installed transformers matches one `_keep_in_fp32_modules` entry: transformers
    5's own glob alternation (searched in the name, as `keep_pattern`); transformers 4's whole
    dotted segments."""
    try:
        from transformers.core_model_loading import build_glob_alternation
    except ImportError:  # transformers 4.x
        return lambda module: re.compile(rf"((^|\.){module}($|\.))")
    return lambda module: build_glob_alternation([module])[0]


def model_keep_patterns(model: Any) -> tuple[KeepPattern, ...]:
    """The keep patterns of a transformers model (an instance: a composite model collects its
    parts' lists when it is built), matched as the installed transformers matches them when
    it loads a model (`_glob_regex`)."""
    regex = _glob_regex()
    return tuple(
        KeepPattern(module, f"{type(model).__name__}.{attr}", regex(module))
        for attr in MODEL_KEEP_LISTS
        for module in sorted(getattr(model, attr, None) or ())
    )


def cast_rules(
    target: Any | None, keep: Sequence[str] = (), model: Sequence[KeepPattern] = ()
) -> CastRules:
    """The rules of an output: `target` (None: as stored), the `--keep_dtype` patterns, the
    model's own (`model_keep_patterns`)."""
    return CastRules(target, (*model, *(keep_pattern(p) for p in keep)))
