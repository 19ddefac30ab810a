"""`shardforge evaluate CONFIG`: the eval loss and perplexity of the trained model on the config's
evaluation data (Axolotl's `evaluate`), the numbers `train` logs for the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from shardforge.cli._common import config_argument, fire_entry, run_on_model, shardforge_command
from shardforge.use.request import ModelRequest

EPILOG = """\b
Examples:
  # the run's own model (full-model save, adapter, else the latest checkpoint merged on the fly)
  shardforge evaluate cfg.yml
  # the checkpoint of step 200 (merged on the fly), as a JSON document
  shardforge evaluate cfg.yml --step 200 --json
  # a merged model; a LoRA adapter on base_model
  shardforge evaluate cfg.yml --model_dir outputs/merged
  shardforge evaluate cfg.yml --base_model outputs/merged     # as Axolotl's --base-model
  shardforge evaluate lora.yml --lora_model_dir outputs/lora
  # other evaluation data or batch size (config overrides)
  shardforge evaluate cfg.yml --val_set_size 0.05 --eval_batch_size 8
  python -m shardforge.cli.evaluate cfg.yml --step 200
"""


def do_evaluate(config: str | Path, override_args: list[str] | None = None, **options: Any) -> Any:
    """Load `config` (plus overrides) and evaluate (`options`: the fields of `ModelRequest`)."""
    from shardforge.use.evaluate import evaluate_model

    return run_on_model(evaluate_model, config, override_args, options)


@shardforge_command(
    "evaluate",
    epilog=EPILOG,
    params=[
        config_argument(),
        click.Option(["--json", "as_json"], is_flag=True, help="Print one JSON document."),
    ],
    request=ModelRequest,
)
def command(config: str, as_json: bool, overrides: list[str], **options: Any) -> str:
    """Evaluate the model CONFIG's run trained (--model_dir, --lora_model_dir, --checkpoint /
    --step, --base_model DIR as Axolotl's --base-model, or by default the run's own) on the config's evaluation data (val_set_size or
    test_datasets) with training's own data pipeline and loss: eval_loss, eval_perplexity and
    eval_tokens, as `train` logs them."""
    result = do_evaluate(config, overrides, **options)
    metrics = {
        "eval_loss": result.loss,
        "eval_perplexity": result.perplexity,
        "eval_tokens": result.tokens,
    }
    if as_json:
        return json.dumps(metrics) + "\n"
    return "".join(f"{k}: {v!r}\n" for k, v in metrics.items())


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
