"""`shardforge inference CONFIG [--prompt TEXT]`: generate from the trained model (Axolotl's
`inference`), streaming the new text to stdout."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import click

from shardforge.cli._common import (
    config_argument,
    fire_entry,
    quiet_libraries,
    run_on_model,
    shardforge_command,
)
from shardforge.use.request import InferenceRequest

EPILOG = """\b
Examples:
  # the run's own model: the full-model save in output_dir, the adapter of a LoRA run, else
  # the latest checkpoint merged on the fly
  shardforge inference examples/tiny-llama.yml --prompt "The robot"
  # a merged model, as Axolotl names it (the run's output_dir is not looked at)
  shardforge inference examples/tiny-llama.yml --base_model outputs/tiny-llama-merged \
      --prompt "The robot"
  # a merged model directory, 40 new tokens
  shardforge inference examples/tiny-llama.yml --model_dir outputs/tiny-llama-merged \\
      --prompt "The robot" --max_new_tokens 40
  # the base model with a LoRA adapter (peft)
  shardforge inference lora.yml --lora_model_dir outputs/lora --prompt "Hello"
  # the checkpoint of step 100, merged on the fly
  shardforge inference cfg.yml --step 100 --prompt "The robot"
  # the prompt on standard input; sampling (seeded by the config's seed)
  echo "Once upon a time" | shardforge inference cfg.yml --do_sample --temperature 0.8 \\
      --top_p 0.9 --seed 3
  # a multi-turn chat in the terminal (/help lists its commands), or on a page in the browser
  shardforge inference cfg.yml --model_dir outputs/merged --chat
  shardforge inference cfg.yml --model_dir outputs/merged --gradio --gradio_server_port 7860
  python -m shardforge.cli.inference cfg.yml --prompt "The robot"
"""


def read_stdin() -> str:
    """The prompt on standard input, read to its end (one line end at the end dropped)."""
    if sys.stdin.isatty():
        click.echo("prompt (end it with Ctrl-D):", err=True)
    text = sys.stdin.read()
    return text[:-1] if text.endswith("\n") else text


def do_inference(config: str | Path, override_args: list[str] | None = None, **options: Any) -> Any:
    """Load `config` (plus overrides) and generate, streaming to stdout (`options`: the fields
    of `InferenceRequest`, as the command line gives them); with `chat` the chat in the
    terminal, with `gradio` the chat page, until the user leaves."""
    from shardforge.use.inference import inference

    if options.get("chat") or options.get("gradio"):
        return run_on_model(do_chat, config, override_args, options, quiet=False)
    generate = functools.partial(inference, read_prompt=read_stdin, stream=True)
    return run_on_model(generate, config, override_args, options)


def do_chat(cfg: Any, named_base: bool, **options: Any) -> None:
    """`--chat` (the terminal) or `--gradio` (the page): the options checked and Gradio found
    before the model is loaded."""
    from shardforge.use.chat import open_chat
    from shardforge.use.request import InferenceRequest

    InferenceRequest(**options)  # conflicts first
    page = bool(options.get("gradio"))
    with quiet_libraries():
        if page:
            from shardforge.use.gradio_page import import_gradio, serve

            import_gradio()
        config, loaded, settings, name = open_chat(cfg, named_base, page, **options)
        if page:
            serve(loaded, config, settings, name)
        else:
            from shardforge.use.chat_terminal import chat

            chat(loaded, config, settings, name)


@shardforge_command(
    "inference",
    epilog=EPILOG,
    params=[config_argument()],
    request=InferenceRequest,
)
def command(config: str, overrides: list[str], **options: Any) -> None:
    """Generate text from the model CONFIG's run trained: --model_dir (a merged model),
    --lora_model_dir (base_model + a PEFT adapter), --checkpoint / --step (merged on the fly),
    --base_model DIR (a full fine-tune's merged model, as Axolotl's --base-model), or by
    default the run's own. The prompt (--prompt, else standard input) is rendered with
    the config's chat_template when it sets one. Greedy unless --do_sample; the new text is
    streamed to stdout, what was loaded to stderr. --chat: a multi-turn chat in the terminal;
    --gradio: a chat page in the browser (127.0.0.1 unless gradio_server_name says otherwise)."""
    do_inference(config, overrides, **options)


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
