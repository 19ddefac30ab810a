"""`shardforge preprocess CONFIG`: tokenize, template, mask and pack the data sets once into
dataset_prepared_path, where `train` finds them (as Axolotl's `axolotl preprocess`)."""

from __future__ import annotations

import logging
from pathlib import Path

from shardforge.cli._common import config_argument, fire_entry, load_config, shardforge_command

log = logging.getLogger("shardforge")

EPILOG = """\b
Examples:
  shardforge preprocess examples/tiny-llama.yml --dataset_prepared_path prepared
  shardforge preprocess cfg.yml                     # into cfg.yml's dataset_prepared_path
  shardforge preprocess cfg.yml --sequence_len 4096 # train must use the same values to reuse it
  CUDA_VISIBLE_DEVICES= shardforge preprocess cfg.yml   # needs no GPU
  python -m shardforge.cli.preprocess cfg.yml
Then `shardforge train cfg.yml` logs "using prepared dataset at ...".
"""

# where Axolotl's preprocess writes when dataset_prepared_path is not set
DEFAULT_PREPARED_PATH = "last_run_prepared"


def do_preprocess(config: str | Path, override_args: list[str] | None = None) -> str:
    """Prepare the data sets of `config` (plus overrides) into its dataset_prepared_path, or
    reuse the folder already there for the same inputs; return the line that reports it."""
    from shardforge.train.data import load_tokenizer
    from shardforge.train.preflight import DATA_CHECKS, preflight
    from shardforge.train.prepared import prepare, summary

    cfg = load_config(config, override_args, "train")
    preflight(cfg, str(config), checks=DATA_CHECKS)
    root = cfg.dataset_prepared_path
    if root is None:
        root = DEFAULT_PREPARED_PATH
        log.warning(
            "warning: dataset_prepared_path is not set; preparing into ./%s (train uses it "
            "only with dataset_prepared_path: %s in the config)",
            root,
            root,
        )
    result = prepare(cfg, load_tokenizer(cfg), Path(root), report=False)  # printed once, here
    state = "written" if result.built else "up to date"
    return f"prepared dataset {result.folder} ({state}): {summary(result.data)}\n"


@shardforge_command("preprocess", epilog=EPILOG, params=[config_argument()])
def command(config: str, overrides: list[str]) -> str:
    """Tokenize, apply chat templates and masking, and pack (or pad) the data sets of CONFIG
    once, into a folder of dataset_prepared_path named by the hash of the data files, the
    tokenizer and the keys that change tokens; `train` with the same config reuses it. An
    up-to-date folder is reused, a damaged one prepared again. Needs no GPU."""
    return do_preprocess(config, overrides)


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
