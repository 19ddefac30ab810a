"""The fuse of a LoRA adapter into its base model's tensors, as sources: `fuse_sources`.

Shared by `merge-lora` (an adapter directory, `merge.lora`) and the merge of a LoRA training
checkpoint (`merge.prepare`): base tensors by Hugging Face name + the adapter's names and
sources -> the output's sources. Every problem (untargeted or unknown modules, factor shapes,
modules_to_save copies, tied weights) is collected and reported in one `MergeError` before
anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shardforge.errors import MergeError, shown
from shardforge.formats.sources import FusedLoraSource, TensorSource
from shardforge.io.copy import ReadCache
from shardforge.keymap.keys import same_tensor
from shardforge.keymap.lora import LoraNames, LoraPair
from shardforge.keymap.lora_settings import LoraSettings
from shardforge.merge.check import ExpectedModel

# what changed a stored tensor, when a modules_to_save copy did
SAVED_COPY = "a modules_to_save copy"


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _factor_problems(
    module: str,
    weight: tuple[int, ...],
    a: TensorSource,
    b: TensorSource,
    r: int,
    transposed: bool,
) -> list[str]:
    """What is wrong with the shapes of one module's factors (A is (r, in), B is (out, r)).

    `transposed`: an embedding (A is (r, num_embeddings), B (dim, r)) or a fan_in_fan_out
    weight stored as (in, out); either way the delta is (B @ A).T."""
    if len(weight) != 2:
        return [f"{module}: the base weight {list(weight)} is not a matrix"]
    rows, cols = weight
    want_a, want_b = ((r, rows), (cols, r)) if transposed else ((r, cols), (rows, r))
    out = []
    for label, src, want in (("A", a, want_a), ("B", b, want_b)):
        if tuple(src.shape) != want:
            out.append(
                f"{module}: LoRA {label} is {list(src.shape)}, expected {list(want)} "
                f"(base weight {list(weight)}, r={r})"
            )
        if not src.dtype.is_floating_point:
            out.append(f"{module}: LoRA {label} has dtype {src.dtype}, not a floating type")
    return out


@dataclass
class _Fusion:
    """One fuse in progress: the output's sources so far and every problem found."""

    names: LoraNames
    tensors: Mapping[str, TensorSource]
    settings: LoraSettings
    expected: ExpectedModel
    out: dict[str, TensorSource] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    changed: dict[str, str] = field(default_factory=dict)  # output name -> what changed it
    copies: dict[str, list[str]] = field(default_factory=dict)  # output name -> tied copies

    def start(self, base: Mapping[str, TensorSource]) -> None:
        """The base tensors, the adapter's own base copies over them, checked by name and
        shape; the output starts as the stored ones."""
        merged = {**base, **{hf: self.tensors[n] for hf, n in self.names.base.items()}}
        shapes = self.expected.shapes
        self.problems += [
            f"base tensor {n} is not part of the architecture" for n in merged if n not in shapes
        ]
        for name in self.expected.saved_names:
            if name not in merged:
                self.problems.append(f"base tensor {name} is missing")
            elif tuple(merged[name].shape) != shapes[name]:
                self.problems.append(
                    f"base tensor {name} is {list(merged[name].shape)}, the architecture has "
                    f"{list(shapes[name])}"
                )
        self.out = {n: merged[n] for n in self.expected.saved_names if n in merged}

    def fuse_pair(self, module: str, pair: LoraPair) -> None:
        """One adapted module: its weight becomes W + scale * B @ A."""
        weight = f"{module}.{pair.weight}"
        settings = self.settings
        if not settings.targets(module):
            self.problems.append(
                f"{module}: the adapter holds LoRA weights for it, but its target_modules "
                f"({shown(settings.target_modules, 80)}) do not name it"
            )
            return
        stored = self.expected.tied.get(weight, weight)
        if weight not in self.expected.shapes or stored not in self.out:
            self.problems.append(f"{module}: the adapter adapts it, the base model has no {weight}")
            return
        transposed = pair.embedding or settings.fan_in_fan_out
        a, b = self.tensors[pair.a], self.tensors[pair.b]
        found = _factor_problems(
            module, self.expected.shapes[weight], a, b, settings.rank(module), transposed
        )
        if found:
            self.problems += found
            return
        if stored in self.changed:
            self.problems.append(
                f"{module}: {weight} is tied to {stored}, which {self.changed[stored]} changes "
                "too; two changes of one tied weight are not fused"
            )
            return
        self.changed[stored] = f"the LoRA of {module}"
        self.out[stored] = FusedLoraSource(
            self.out[stored], a, b, settings.scale(module), transposed
        )

    def _copy_problem(self, hf: str, stored: str, src: TensorSource) -> str | None:
        """Why a modules_to_save copy of `hf` (stored as `stored`) cannot be taken."""
        kept, settings = self.expected.tied, self.settings
        module = _module_of(hf)
        partners = [stored, *(t for t, s in kept.items() if s == stored)]
        # with ensure_weight_tying peft saves the tied partner too, naming only one of them
        named = settings.saves(module) or (
            settings.ensure_weight_tying and any(settings.saves(_module_of(p)) for p in partners)
        )
        if not named:
            return (
                f"{hf}: the adapter holds a copy of it, but modules_to_save "
                f"({shown(list(settings.modules_to_save), 80)}) does not name {module}"
            )
        if hf not in self.expected.shapes or stored not in self.out:
            return f"{hf}: a modules_to_save copy of a tensor the base model lacks"
        if tuple(src.shape) != self.expected.shapes[hf]:
            return (
                f"{hf}: the modules_to_save copy is {list(src.shape)}, the base model has "
                f"{list(self.expected.shapes[hf])} (a resized vocabulary is not fused)"
            )
        if hf != stored and not settings.ensure_weight_tying:
            return (
                f"{hf}: a modules_to_save copy of a weight tied to {stored}, which the saved "
                "model stores for both (untie the weights first: see `unties`)"
            )
        return None

    def take_copy(self, hf: str, input_name: str) -> None:
        """One modules_to_save copy: it replaces the stored tensor."""
        stored = self.expected.tied.get(hf, hf)
        src = self.tensors[input_name]
        problem = self._copy_problem(hf, stored, src)
        if problem is not None:
            self.problems.append(problem)
            return
        self.copies.setdefault(stored, []).append(hf)
        if stored in self.changed and self.changed[stored] != SAVED_COPY:
            self.problems.append(f"{hf}: changed by both {self.changed[stored]} and {SAVED_COPY}")
            return
        self.changed[stored] = SAVED_COPY
        if hf == stored:
            self.out[stored] = src

    def check_tied_copies(self) -> None:
        for stored, found in self.copies.items():
            if len(found) > 1 or found[0] != stored:
                self.problems += _tied_copies(stored, found, self.names, self.tensors)


def fuse_sources(
    base: Mapping[str, TensorSource],
    names: LoraNames,
    tensors: Mapping[str, TensorSource],
    settings: LoraSettings,
    expected: ExpectedModel,
    source: str,
) -> dict[str, TensorSource]:
    """The output's sources, by Hugging Face name, in `expected.saved_names` order.

    `base`: the base model's tensors by Hugging Face name (tied targets may be present: they
    are dropped); `names.base` (the adapter's own base copies, e.g. embeddings saved with
    ``save_embedding_layers``, or every base tensor of a LoRA training checkpoint) override
    them; `tensors`: input name -> source for every name in `names`. One MergeError lists
    every problem (untargeted or unknown modules, shapes, tied weights) before anything is
    written.
    """
    fusion = _Fusion(names, tensors, settings, expected)
    fusion.start(base)
    for module, pair in names.pairs.items():
        fusion.fuse_pair(module, pair)
    for hf, input_name in names.replacements.items():
        fusion.take_copy(hf, input_name)
    fusion.check_tied_copies()
    problems = fusion.problems
    if problems:
        raise MergeError(
            f"the adapter does not fit the base model ({len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''}); check base_model and lora_model_dir",
            [f"{source}: {p}" if i == 0 else p for i, p in enumerate(problems)],
        )
    return fusion.out


def _tied_copies(
    stored: str, found: list[str], names: LoraNames, tensors: Mapping[str, TensorSource]
) -> list[str]:
    """The saved copies of one tied pair (ensure_weight_tying) must be the same tensor; the
    one stored under the kept name is written."""
    if stored not in found:
        return [f"{stored}: only its tied partner {found[0]} has a modules_to_save copy"]
    with ReadCache() as reader:
        first = tensors[names.replacements[stored]].read(reader)
        for other in found:
            if other != stored:
                copy = tensors[names.replacements[other]].read(reader)
                if not same_tensor(first, copy):
                    return [
                        f"{other}: its modules_to_save copy differs from {stored}'s, to "
                        "which it is tied"
                    ]
    return []


def unties(names: LoraNames, settings: LoraSettings, expected: ExpectedModel) -> list[str]:
    """The tied targets (``lm_head.weight``) that a modules_to_save copy of one member of
    their pair unties: without ``ensure_weight_tying`` peft's `merge_and_unload` sets
    ``tie_word_embeddings`` false and keeps the copy on one side and the original on the
    other, so the merged model stores both."""
    if settings.ensure_weight_tying:
        return []
    saved = set(names.replacements)
    return sorted(t for t, s in expected.tied.items() if t in saved or s in saved)


__all__ = ["fuse_sources", "unties"]
