"""The model keys: base model, tokenizer, chat template, output folder."""

from __future__ import annotations

from typing import Any

from pydantic import field_serializer

from shardforge.config.view import ConfigView

# the keys of `storage_options` whose values are secrets (never shown, never dumped)
STORAGE_SECRET_KEYS = ("secret", "token", "aws_secret_access_key", "aws_session_token", "password")


class ModelKeys(ConfigView):
    """The model, its tokenizer and where the run writes."""

    # -- model -----------------------------------------------------------------------------------
    base_model: str
    """Local directory or Hugging Face hub id of the base model (weights, config, tokenizer)."""
    base_model_config: str | None = None
    """Where to read config.json from, when not from base_model."""
    model_config_overrides: dict[str, Any] | None = None
    """Values set on the model's config before it is built, e.g. {rope_scaling: {rope_type: linear,
    factor: 2.0}}; the saved config.json holds them. Axolotl's model_config (and its older
    overrides_of_model_config) is read as this key."""
    model_kwargs: dict[str, Any] | None = None
    """Axolotl's extra from_pretrained arguments: an attribute of the model's config is set on it
    (as from_pretrained sets such keywords), `dtype` / `torch_dtype` is the dtype the weights are
    kept in (as bfloat16 / float16); any other is refused. overrides_of_model_kwargs is read as this
    key."""
    bfloat16: bool = False
    """Keep the weights (and so the gradients and optimizer state) in bfloat16 instead of float32:
    half the memory, no float32 master copy (Axolotl loads the model in bfloat16). Compute follows
    bf16 / fsdp.mixed_precision as before."""
    float16: bool = False
    """Keep the weights in float16 instead of float32 (as bfloat16)."""
    resize_token_embeddings_to_32x: bool = False
    """Give the embeddings (and output layer) a row count that is a multiple of 32: len(tokenizer)
    rounded up (when the model has fewer rows; with shrink_embeddings also when it has more)."""
    shrink_embeddings: bool = False
    """Cut the embedding rows the tokenizer does not use: the model's vocab_size becomes
    len(tokenizer) (rounded up to 32 with resize_token_embeddings_to_32x)."""
    mean_resizing_embeddings: bool | None = None
    """Rows added to the embeddings: true or null: the mean of the existing rows (transformers'
    default; deterministic); false: drawn from a normal distribution (0, the config's
    initializer_range), as transformers' resize without mean_resizing."""
    fix_untrained_tokens: int | list[int] | bool | None = None
    """Token ids whose embedding rows (input and output) were never trained (every value within
    1e-16 of 0) are set to the mean of the trained rows before training, as Axolotl's
    fix_untrained_tokens: true: any such token that the training data contains; an id or a list of
    ids: those tokens."""
    tokenizer_config: str | None = None
    """Where to read the tokenizer from, when not from base_model."""
    tokenizer_use_fast: bool | None = None
    """Load the fast (Rust tokenizers) tokenizer; false: the slow one (e.g. sentencepiece) where the
    model has it. null: fast."""
    tokenizer_legacy: bool | None = None
    """The `legacy` flag of Llama/T5-style sentencepiece tokenizers (how text after a special token
    is split). null: the tokenizer's own setting."""
    trust_remote_code: bool = False
    """Allow model/tokenizer code shipped with the model to run. Off by default."""
    chat_template: str | None = None
    """Chat template for chat_template data sets and the saved tokenizer: a name of Axolotl's (see
    docs/config.md: chatml, llama3, gemma3, qwen3, tokenizer_default,
    tokenizer_default_fallback_<name>, jinja, ...) or Jinja text (containing `{%` or `{{`). null:
    the tokenizer's own. train refuses an unknown name; the merge keeps the tokenizer's own template
    then."""
    chat_template_jinja: str | None = None
    """The Jinja text (or a file holding it) used when `chat_template: jinja` or unset."""
    attn_implementation: str | None = None
    """Attention kernel passed to transformers: eager, sdpa, flex_attention, flash_attention_2, ...,
    or varlen_attention (shardforge's: torch's variable-length attention, GPU, bf16/fp16) (null: the
    transformers default). With sample_packing, sdpa switches to one without a dense mask where one
    runs (docs/train.md). Axolotl's flash_attention / sdp_attention / eager_attention /
    flex_attention flags set it."""
    special_tokens: dict[str, str] | None = None
    """Tokenizer special tokens to set, e.g. {pad_token: '<|pad|>', eos_token: '<|im_end|>'}; new
    ones are added to the vocabulary (embeddings resized before sharding) and saved with the
    tokenizer."""
    tokens: list[str] | None = None
    """Extra tokens added to the tokenizer's vocabulary (embeddings resized before sharding)."""
    eot_tokens: list[str] | None = None
    """End-of-turn tokens of the chat template: each must be a single token; in trained turns they
    are trained on (added as special tokens when missing)."""
    output_dir: str = "./model-out"
    """Where training writes checkpoints; where the merge looks for them."""
    storage_options: dict[str, Any] | None = None
    """Options of the object store for s3:// paths (output_dir, --checkpoint, --output_path): s3fs
    keywords such as endpoint_url, key, secret, client_kwargs; what is not set comes from the AWS
    environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL). Secrets are
    never shown: a dump of the config (validate, tracking) has *** in their place; prefer the
    environment for them."""
    seed: int = 42
    """Random seed for model init, data order and dropout."""

    @field_serializer("storage_options")
    def _secrets_hidden(self, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """A dump (validate, tracking, a saved config) never holds a secret."""
        if value is None:
            return None
        return {k: "***" if k in STORAGE_SECRET_KEYS and v else v for k, v in value.items()}
