"""The options of `shardforge inference` and `shardforge evaluate`, one field each (their help in
`option(...)`, as the merge's `MergeRequest`): the command-line options and `--help` derive from
them (`cli._common.request_options`). Torch-free: `--help` imports this module alone.

    ModelRequest       which weights: --model_dir, --lora_model_dir, --checkpoint / --step
    InferenceRequest   that, the prompt and transformers' generation options, --chat, --gradio
    QuantizeRequest    `quantize`: Axolotl's flags (--base_model, --weight_dtype, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardforge.errors import ShardforgeError
from shardforge.merge.options import flag, optional, parse_fields, parse_local_path

# the most tokens generated when --max_new_tokens is not given
DEFAULT_MAX_NEW_TOKENS = 256


def refuse(problems: list[str], what: str) -> None:
    """Raise the problems of a request as one error (nothing when there are none)."""
    if len(problems) == 1:
        raise ShardforgeError(problems[0])
    if problems:
        raise ShardforgeError(f"{len(problems)} {what}:", [f"- {p}" for p in problems])


@dataclass(frozen=True)
class ModelRequest:
    """Which weights to use; none given: the run's own (see `shardforge.use.model.pick`)."""

    model_dir: Path | None = optional(
        "A Hugging Face model directory (e.g. the output of merge-sharded-fsdp-weights or "
        "merge-lora).",
        metavar="DIR",
        doc="Safetensors weights only.",
        parse=parse_local_path,
    )
    lora_model_dir: Path | None = optional(
        "A PEFT adapter directory, applied to the config's base_model with peft (default "
        "for a run with `adapter`: the config's lora_model_dir, else output_dir when it "
        "holds the adapter).",
        metavar="DIR",
        doc="`PeftModel.from_pretrained`: unfused, as training ran it.",
        parse=parse_local_path,
    )
    checkpoint: Path | None = optional(
        "A sharded checkpoint (or a run folder) to merge on the fly into a temporary "
        "directory, read as merge-sharded-fsdp-weights --checkpoint reads it (default: the "
        "run's latest, when output_dir holds no final model).",
        metavar="PATH",
        doc="See [Which model](inference.md#which-model).",
        parse=parse_local_path,
    )
    step: int | None = optional(
        "Merge the checkpoint of this step on the fly instead of the latest.",
        type=int,
        metavar="N",
    )

    def __post_init__(self) -> None:
        refuse(parse_fields(self) + self.problems(), "conflicting options")

    def problems(self) -> list[str]:
        """What is wrong with the options together (a subclass adds its own)."""
        given = [
            flag
            for flag, on in (
                ("--model_dir", self.model_dir is not None),
                ("--lora_model_dir", self.lora_model_dir is not None),
                ("--checkpoint/--step", self.checkpoint is not None or self.step is not None),
            )
            if on
        ]
        out = []
        if len(given) > 1:
            out.append(f"{' and '.join(given)} each name the model; give one of them")
        if self.step is not None and self.step < 0:
            out.append(f"--step {self.step}: expected a step number (0 or more)")
        return out


# the generation options that apply to sampling only
SAMPLING = ("temperature", "top_k", "top_p", "min_p")
# (option, is its value allowed, what is expected)
CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("max_new_tokens", lambda v: v >= 1, "1 or more"),
    ("temperature", lambda v: v > 0, "a value above 0"),
    ("top_k", lambda v: v >= 0, "0 or more"),
    ("top_p", lambda v: 0 < v <= 1, "a value in (0, 1]"),
    ("min_p", lambda v: 0 <= v <= 1, "a value in [0, 1]"),
    ("repetition_penalty", lambda v: v > 0, "a value above 0"),
)


@dataclass(frozen=True)
class InferenceRequest(ModelRequest):
    """The model, the prompt and how to generate (transformers' `generate` keywords)."""

    prompt: str | None = optional(
        "The prompt (default: standard input, read to its end). Where the run trained with a "
        "chat template (the config's chat_template, or chat_template data sets with the "
        "tokenizer's own) it is the user message of a one-turn conversation.",
        metavar="TEXT",
    )
    raw_prompt: bool = flag(
        "Tokenize the prompt as it is, without the chat template the run trained with.",
        doc="For a chat run, the text a completion model would continue.",
    )
    max_new_tokens: int | None = optional(
        f"Most tokens to generate (default {DEFAULT_MAX_NEW_TOKENS}).",
        type=int,
        metavar="N",
        doc="Generation also stops at the model's end-of-sequence tokens and the config's "
        "`eot_tokens`.",
    )
    do_sample: bool = flag(
        "Sample the next token (default: greedy decoding).",
        doc="Seeded by the config's `seed` (`--seed 3`): the same seed, the same answer.",
    )
    temperature: float | None = optional(
        "Sampling temperature, above 0 (with --do_sample).", type=float, metavar="T"
    )
    top_k: int | None = optional(
        "Sample among the K likeliest tokens (with --do_sample).", type=int, metavar="K"
    )
    top_p: float | None = optional(
        "Nucleus sampling: the smallest set of tokens holding probability P, P in (0, 1] "
        "(with --do_sample).",
        type=float,
        metavar="P",
    )
    min_p: float | None = optional(
        "Drop tokens less likely than P x the likeliest one, P in [0, 1] (with --do_sample).",
        type=float,
        metavar="P",
    )
    repetition_penalty: float | None = optional(
        "Penalty on tokens already in the text, above 0 (1.0: none; greedy decoding too).",
        type=float,
        metavar="X",
    )
    chat: bool = flag(
        "A multi-turn chat in the terminal, with slash commands (/help) and the generation "
        "settings changed as it runs.",
        doc="See [--chat](inference.md#chat-in-the-terminal---chat). The generation options "
        "are its starting settings (sampling by default, as Axolotl's).",
    )
    gradio: bool = flag(
        "A multi-turn chat page in the browser (Gradio, the `ui` extra), on 127.0.0.1 unless "
        "gradio_server_name says otherwise.",
        doc="See [--gradio](inference.md#a-chat-page---gradio). Not with --chat.",
    )

    def problems(self) -> list[str]:
        out = super().problems()
        if self.chat and self.gradio:
            out.append(
                "--chat and --gradio are exclusive: the chat runs in the terminal or on a page"
            )
        if (self.chat or self.gradio) and self.prompt is not None:
            mode = "--chat" if self.chat else "--gradio"
            out.append(f"--prompt with {mode}: the prompts are typed in the chat; drop --prompt")
        if self.prompt is not None and not self.prompt.strip():
            out.append("empty prompt: give --prompt TEXT or the prompt on standard input")
        for name, ok, expected in CHECKS:
            value = getattr(self, name)
            if value is not None and not ok(value):
                out.append(f"--{name} {value}: expected {expected}")
        unused = [f"--{n}" for n in SAMPLING if getattr(self, n) is not None]
        if unused and not (self.do_sample or self.chat or self.gradio):
            out.append(
                f"{', '.join(unused)} only apply to sampling: add --do_sample (greedy decoding "
                "is the default)"
            )
        return out

    def generation_kwargs(self) -> dict[str, Any]:
        """The keywords of transformers' `generate`: greedy unless do_sample, and the options
        given (transformers' own names)."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            "do_sample": self.do_sample,
        }
        for name in (*SAMPLING, "repetition_penalty"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


WEIGHT_DTYPES = ("int8", "int4")
ACTIVATION_DTYPES = ("int8",)


@dataclass(frozen=True)
class QuantizeRequest(ModelRequest):
    """`quantize`: which model (ModelRequest's options, or Axolotl's --base_model DIR) and how
    (Axolotl's flags)."""

    base_model: Path | None = optional(
        "The model directory to quantize, as Axolotl's --base_model (the same as --model_dir).",
        metavar="DIR",
        parse=parse_local_path,
    )
    weight_dtype: str | None = optional(
        "The weights' type: int8 (per output channel) or int4 (groups of --group_size; a "
        "CUDA GPU). Default: the config's quantization.weight_dtype, else int8.",
        choices=WEIGHT_DTYPES,
        doc="torchao's `Int8WeightOnlyConfig` / `Int4WeightOnlyConfig`.",
    )
    activation_dtype: str | None = optional(
        "int8: quantize the activations too, as they come (dynamic); default: the config's "
        "quantization.activation_dtype, else weights only.",
        choices=ACTIVATION_DTYPES,
        doc="torchao's `Int8DynamicActivationInt8WeightConfig` / "
        "`Int8DynamicActivationIntxWeightConfig`.",
    )
    group_size: int | None = optional(
        "Weights per quantization group for int4 (default: the config's "
        "quantization.group_size, else 32, as Axolotl).",
        type=int,
        metavar="N",
    )
    quantize_embedding: bool = flag(
        "Quantize the input embedding (int8 per row) and the LM head too (or the config's "
        "quantization.quantize_embedding; default: kept as they are, as transformers keeps them)."
    )
    output_dir: Path | None = optional(
        "Where to write: OUTPUT_DIR/quantized, as Axolotl (default: the config's output_dir).",
        metavar="DIR",
        parse=parse_local_path,
    )

    def problems(self) -> list[str]:
        out = super().problems()
        if self.base_model is not None and self.model_dir is not None:
            out.append("--base_model and --model_dir each name the model; give one of them")
        elif self.base_model is not None and (
            self.lora_model_dir is not None or self.checkpoint is not None or self.step is not None
        ):
            out.append("--base_model names the model; drop --lora_model_dir/--checkpoint/--step")
        if self.group_size is not None and self.group_size < 1:
            out.append(f"--group_size {self.group_size}: expected 1 or more")
        if self.group_size is not None and self.weight_dtype == "int8":
            out.append("--group_size applies to --weight_dtype int4 (int8 is per output channel)")
        return out
