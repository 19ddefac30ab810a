"""torchtitan -> Hugging Face state-dict adapters (names, RoPE permutation), chosen by model_type."""

from shardforge.keymap.titan.adapter import ADAPTERS, StateDictAdapter, get_adapter, is_model_key

__all__ = ["ADAPTERS", "StateDictAdapter", "get_adapter", "is_model_key"]
