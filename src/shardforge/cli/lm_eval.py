"""`shardforge lm-eval CONFIG`: lm-evaluation-harness over the trained model (Axolotl's
`lm-eval`), run in this process with the model loaded once; the results JSON under
output_dir/lm_eval_results/ and one summary table on stdout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardforge.cli._common import config_argument, fire_entry, run_on_model, shardforge_command
from shardforge.use.request import ModelRequest

EPILOG = """\b
Examples:
  # the config's lm_eval_tasks over the run's own model (as inference picks it)
  shardforge lm-eval cfg.yml
  # a merged model; tasks and batch size as config overrides
  shardforge lm-eval cfg.yml --model_dir outputs/merged --lm_eval_tasks '[hellaswag:10, arc_easy]'
  # a task of your own, from a folder of lm_eval task YAML files (no hub needed)
  shardforge lm-eval cfg.yml --lm_eval_include_path my_tasks --lm_eval_tasks '[my_task]'
  python -m shardforge.cli.lm_eval cfg.yml
"""


def do_lm_eval(config: str | Path, override_args: list[str] | None = None, **options: Any) -> Any:
    """Load `config` (plus overrides) and run lm-eval (`options`: the fields of `ModelRequest`)."""
    from shardforge.use.lm_evaluation import lm_evaluate

    return run_on_model(lm_evaluate, config, override_args, options)


@shardforge_command("lm-eval", epilog=EPILOG, params=[config_argument()], request=ModelRequest)
def command(config: str, overrides: list[str], **options: Any) -> str:
    """Run lm-evaluation-harness over the model CONFIG's run trained (--model_dir,
    --lora_model_dir, --checkpoint / --step, --base_model DIR, the config's lm_eval_model, or
    by default the run's own), loaded once, in this process: the config's lm_eval_tasks (name
    or name:num_fewshot), lm_eval_batch_size, apply_chat_template, fewshot_as_multiturn,
    lm_eval_include_path (local task YAML files). Prints lm_eval's summary table; the results
    JSON goes to output_dir/lm_eval_results/."""
    result = do_lm_eval(config, overrides, **options)
    return str(result.table)


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
