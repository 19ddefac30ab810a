"""Tiny models, tokenizers and data made locally (nothing is downloaded).

Used by the tests, the benchmarks and the shipped example. Run as a module to (re)create the
example's base model and data:

    PYTHONPATH=tests python -m helpers.tiny examples/tiny-llama
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]

_SUBJECTS = [
    "the cat",
    "a dog",
    "the small bird",
    "my friend",
    "the old man",
    "a child",
    "the robot",
]
_VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "builds"]
_OBJECTS = [
    "a red ball",
    "the green tree",
    "a blue box",
    "the big house",
    "a yellow kite",
    "the moon",
]
_PLACES = ["in the park", "by the river", "at home", "near the school", "under the bridge"]


def tiny_sentences(n: int, seed: int = 0) -> list[str]:
    """`n` short, deterministic English-like sentences."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.5:
            words.append(rng.choice(_PLACES))
        out.append(" ".join(words).capitalize() + ".")
    return out


def tiny_texts(n: int, seed: int = 0) -> list[str]:
    """`n` short paragraphs of 2-4 sentences."""
    rng = random.Random(seed + 1)
    sentences = tiny_sentences(4 * n, seed)
    return [" ".join(sentences[4 * i : 4 * i + rng.randint(2, 4)]) for i in range(n)]


def tiny_conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`n` one-turn conversations about the tiny sentences."""
    rng = random.Random(seed + 2)
    out = []
    for s in tiny_sentences(n, seed + 3):
        q = rng.choice(["Tell me a story.", "What happened?", "Say something."])
        out.append([{"role": "user", "content": q}, {"role": "assistant", "content": s}])
    return out


def make_tokenizer(vocab_size: int = 320, seed: int = 0) -> Any:
    """A byte-level BPE tokenizer trained on the tiny corpus, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = tiny_texts(400, seed)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# model_type -> config kwargs for a tiny model of that family (shapes chosen to be awkward:
# hidden and vocab sizes are not divisible by 2 or 3 world sizes in the tests that override them).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    },
}
_SMALL: dict[str, Any] = {**TINY_CONFIGS["llama"], "head_dim": 16}
# more families, for the mixture-of-experts base models (saved per expert, fused at load) and
# the Axolotl example configs of tests/config/axolotl_corpus
TINY_CONFIGS.update(
    {
        "mistral": _SMALL,
        "qwen3": {**_SMALL, "tie_word_embeddings": True},
        "phi3": _SMALL,
        "gemma3_text": {**_SMALL, "sliding_window": 16, "tie_word_embeddings": True},
        "mixtral": {**_SMALL, "num_local_experts": 4, "num_experts_per_tok": 2},
        "qwen3_moe": {
            **_SMALL,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
        "deepseek_v2": {
            **_SMALL,
            # as DeepSeek-V2's own configs: MLA has a key and value per head (with fewer, the
            # attention of transformers 5 fails on any attention mask)
            "num_key_value_heads": 4,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_group": 1,
            "topk_group": 1,
        },
    }
)
MOE_TYPES = ("mixtral", "qwen3_moe", "deepseek_v2")


def make_config(model_type: str = "llama", vocab_size: int = 320, **overrides: Any) -> Any:
    from transformers import AutoConfig

    kwargs = {**TINY_CONFIGS[model_type], **overrides}
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        **kwargs,
    )


def make_model(
    out_dir: str | Path,
    model_type: str = "llama",
    vocab_size: int = 320,
    seed: int = 0,
    dtype: str = "float32",
    with_tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write a randomly initialised tiny model directory (config, weights, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size, seed) if with_tokenizer else None
    if tok is not None and len(tok) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tok)})")
    config = make_config(model_type, vocab_size, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=3, max_new_tokens=20
    )
    model.save_pretrained(out)
    if tok is not None:
        tok.save_pretrained(out)
    return out


# what the parrot model answers by default (its tokens all differ)
PARROT_ANSWER = "The cat sees a red ball."


def make_parrot_model(out_dir: str | Path, answer: str = PARROT_ANSWER) -> Path:
    """A tiny llama (with `make_model`'s tokenizer and chat template) whose every reply to a
    chat prompt is `answer`, then end of sequence, greedy or sampled: its layers add nothing
    (o_proj and down_proj are zero), so each position's state is its token's embedding, and
    the embedding of each token of the chain `<|assistant|>` + `answer` points the LM head at
    the next one (`answer`'s tokens must differ from each other)."""
    import torch
    from safetensors.torch import load_file, save_file

    tok = make_tokenizer(320, 0)
    chain = [tok.convert_tokens_to_ids("<|assistant|>"), *tok.encode(answer), tok.eos_token_id]
    if len(set(chain)) != len(chain) or len(chain) > 64:
        raise ValueError(f"{answer!r}: its tokens repeat (or more than 63); choose another")
    out = make_model(out_dir, "llama", vocab_size=320, seed=0)
    weights = load_file(out / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
    embed = torch.zeros_like(weights["model.embed_tokens.weight"])
    head = torch.zeros_like(weights["lm_head.weight"])
    for k, (token, following) in enumerate(itertools.pairwise(chain)):
        embed[token, k] = 1.0
        head[following, k] = 10.0
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return p


def make_example(root: str | Path) -> None:
    """Create the shipped example: base model, completion data and chat data."""
    root = Path(root)
    make_model(root / "base", "llama", vocab_size=320, seed=0)
    write_jsonl(root / "data" / "stories.jsonl", [{"text": t} for t in tiny_texts(256, seed=0)])
    write_jsonl(
        root / "data" / "chats.jsonl", [{"messages": m} for m in tiny_conversations(64, seed=0)]
    )


if __name__ == "__main__":
    import sys

    make_example(sys.argv[1] if len(sys.argv) > 1 else "examples/tiny-llama")
