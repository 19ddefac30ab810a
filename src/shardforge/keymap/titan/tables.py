"""Constant tables: torchtitan state-dict names -> Hugging Face names, per model family.

``{}`` stands for a layer index. Names are checked against torchtitan's own
``state_dict_adapter.py`` for each family:

* Llama 3, torchtitan before the fused-QKV refactor: ``layers.{}.attention.wq.weight``, ...,
  ``output.weight``.
* Llama 3, torchtitan 0.3.0: ``layers.{}.attention.qkv_linear.wq.weight``, ...,
  ``lm_head.weight`` (the fused ``wqkv`` parameter is split back into ``wq``/``wk``/``wv``
  by torchtitan's own state-dict hook before saving).
* Qwen 3 (dense), torchtitan 0.3.0: the 0.3.0 Llama names plus ``q_norm``/``k_norm``. Its
  RoPE is already HF's half-split form, so no permutation. Qwen 3 MoE (grouped experts) and
  earlier torchtitan Qwen 3 layouts are not supported (their keys are reported as unknown).

Very old torchtitan checkpoints prefix every key with ``model.``; the adapter strips it.
"""

from __future__ import annotations

from typing import Final

# torchtitan name -> HF name, shared by Llama and Qwen 3
_COMMON: Final[dict[str, str]] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}

# torchtitan 0.3.0 keeps q/k/v under `qkv_linear`
_QKV_LINEAR: Final[dict[str, str]] = {
    "layers.{}.attention.qkv_linear.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.qkv_linear.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.qkv_linear.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
}

LLAMA_NAMES: Final[dict[str, str]] = {
    **_COMMON,
    **_QKV_LINEAR,
    # torchtitan before 0.3.0
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "output.weight": "lm_head.weight",
}

QWEN3_NAMES: Final[dict[str, str]] = {
    **_COMMON,
    **_QKV_LINEAR,
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}

# buffers that are not weights (recomputed by the HF model): dropped by name
SKIPPED_NAMES: Final[tuple[str, ...]] = (
    "freqs_cis",
    "layers.{}.attention.rope.cache",
    "rope.cache",
)

# top-level entries of a torchtitan training checkpoint that are not model weights (torchtitan's
# checkpointer saves them beside the flat model keys unless `last_save_model_only` is set)
TRAINING_STATES: Final[tuple[str, ...]] = (
    "optimizer",
    "lr_scheduler",
    "dataloader",
    "train_state",
)

# HF name -> config key holding the number of heads its rows are grouped in, for the RoPE
# q/k row permutation (interleaved pairs -> halves)
LLAMA_ROPE_PERMUTED: Final[dict[str, str]] = {
    "model.layers.{}.self_attn.q_proj.weight": "num_attention_heads",
    "model.layers.{}.self_attn.k_proj.weight": "num_key_value_heads",
}

# the HF output projection, dropped when the config ties it to the input embedding
