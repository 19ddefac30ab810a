"""The keys of the commands that use a trained model: `inference --gradio` (Axolotl's `gradio_*`)
and `lm-eval` (Axolotl's `lm_eval_*`, with `apply_chat_template` and `fewshot_as_multiturn`,
which Axolotl's `lm-eval` reads from the YAML without declaring them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from shardforge.config.paths import local_path
from shardforge.config.view import ConfigView


class QuantizationConfig(ConfigView):
    """Axolotl's `quantization:` block (its PTQConfig), read by `shardforge quantize`; the
    command's flags win over it."""

    weight_dtype: Literal["int8", "int4"] = "int8"
    """The weights' type: int8 per output channel, or int4 in groups."""
    activation_dtype: Literal["int8"] | None = None
    """int8: the activations quantized as they come too (dynamic)."""
    group_size: int | None = Field(None, ge=1)
    """Weights per group for int4 (default 32, as Axolotl)."""
    quantize_embedding: bool | None = None
    """Quantize the input embedding and the LM head too."""


class UseKeys(ConfigView):
    """Using the trained model: the chat page and lm-evaluation-harness."""

    # -- inference --gradio ----------------------------------------------------------------------
    gradio_title: str | None = None
    """Title of the `inference --gradio` page (default: shardforge and the config's name)."""
    gradio_share: bool | None = None
    """true: ask Gradio for a public share link (it reaches gradio.live). Off by default (Axolotl's
    default is on): the page is local only."""
    gradio_server_name: str | None = None
    """Address the page binds to (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the
    network)."""
    gradio_server_port: int | None = Field(None, ge=1, le=65535)
    """Port of the page (default: Gradio's, 7860 or the next free)."""
    gradio_max_new_tokens: int | None = Field(None, ge=1)
    """The page's starting max new tokens (default 1024, as Axolotl)."""
    gradio_temperature: float | None = Field(None, ge=0)
    """The page's starting temperature (default 0.9, as Axolotl; 0: greedy)."""
    # -- quantize --------------------------------------------------------------------------------
    quantization: QuantizationConfig | None = None
    """How `shardforge quantize` quantizes (Axolotl's block: weight_dtype, activation_dtype,
    group_size, quantize_embedding); its flags win."""
    # -- lm-eval ---------------------------------------------------------------------------------
    lm_eval_tasks: list[str] = Field([])
    """lm-evaluation-harness tasks for `shardforge lm-eval`: `name` or `name:num_fewshot`; a task's
    YAML may lie in a local folder (`lm_eval_include_path`)."""
    lm_eval_batch_size: int | None = Field(8, ge=1)
    """lm-eval batch size."""
    lm_eval_model: str | None = None
    """A model directory for lm-eval instead of the run's own (as `--model_dir`)."""
    lm_eval_include_path: str | None = None
    """A folder of local lm-eval task YAML files (lm_eval's --include_path): tasks without the
    hub."""
    apply_chat_template: bool = False
    """lm-eval: render each request with the model's chat template."""
    fewshot_as_multiturn: bool = False
    """lm-eval: the few-shot examples as turns of a conversation (with apply_chat_template)."""

    @field_validator("lm_eval_model", "lm_eval_include_path")
    @classmethod
    def _use_local_paths(cls, value: str | None) -> str | None:
        """Read as local paths."""
        return local_path(value, "a local path")
