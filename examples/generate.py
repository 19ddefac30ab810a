"""Load a merged model directory with plain transformers and print a short greedy generation.

python examples/generate.py outputs/tiny-llama-merged --prompt "The cat"
"""

from __future__ import annotations

import argparse

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def generate(model_dir: str, prompt: str, max_new_tokens: int = 24) -> str:
    transformers.logging.disable_progress_bar()  # the answer, not a "Loading weights" bar
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return str(tokenizer.decode(out[0], skip_special_tokens=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="a Hugging Face model directory (e.g. the merge output)")
    parser.add_argument("--prompt", default="The cat")
    parser.add_argument("--max_new_tokens", type=int, default=24)
    args = parser.parse_args()
    print(generate(args.model_dir, args.prompt, args.max_new_tokens))


if __name__ == "__main__":
    main()
