"""`shardforge merge-sharded-fsdp-weights CONFIG --output_path DIR`: merge a sharded FSDP (DCP)
checkpoint into a complete Hugging Face model directory, streaming with bounded memory.

Axolotl's names are here too: `merge_fsdp_weights` (its arguments) and `do_cli` (its fire entry
point); they import the merge (and torch) only when called."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from shardforge.cli._common import (
    config_argument,
    fire_entry,
    load_config,
    quiet_libraries,
    shardforge_command,
)
from shardforge.errors import CheckpointError
from shardforge.merge.request import MergeRequest

log = logging.getLogger("shardforge")

EPILOG = """\b
Examples:
  # latest complete checkpoint under the config's output_dir
  shardforge merge-sharded-fsdp-weights examples/tiny-llama.yml    # to <output_dir>/merged
  shardforge merge-sharded-fsdp-weights examples/tiny-llama.yml --output_path outputs/merged
  # a given step, cast to bf16, verified, 5GB shards
  shardforge merge-sharded-fsdp-weights cfg.yml --output-path out --step 200 \\
      --dtype bfloat16 --verify --max_shard_size 5GB
  # an HF Trainer / accelerate checkpoint
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out \\
      --checkpoint runs/checkpoint-500/pytorch_model_fsdp_0
  # a Lightning sharded checkpoint
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out \\
      --checkpoint lightning_logs/version_0/checkpoints/last.ckpt
  # verl / LMMs-Engine per-rank files (model_world_size_W_rank_R.pt), latest step
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --checkpoint checkpoints/
  # the EMA weights of step 500
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --step 500 \\
      --state_dict_dirname pytorch_ema_model_fsdp_0
  # a torchtitan step-N/ checkpoint (names mapped by the config's model_type)
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --checkpoint outputs/checkpoint
  # every checkpoint of the run, each to out/step-N (or --steps 100,200)
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --all_steps
  # a checkpoint in object storage, the model uploaded there (AWS_ACCESS_KEY_ID,
  # AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL; or the config's storage_options; docs/storage.md)
  shardforge merge-sharded-fsdp-weights cfg.yml --checkpoint s3://ckpts/run-7 \
      --output_path s3://models/run-7 --verify
  # on 4 CPU ranks of this machine (2 machines: --nnodes 2 --node_rank R --rdzv_endpoint H:P)
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --nproc_per_node 4
  # a LoRA run (adapter: lora): a PEFT adapter directory, or the fused model
  shardforge merge-sharded-fsdp-weights lora.yml --output_path out/adapter
  shardforge merge-sharded-fsdp-weights lora.yml --output_path out/merged --merge_lora
  # the mean of the last 3 checkpoints (or --average_steps 100,200,300)
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --average_last 3
  # one safetensors file; one torch file {"state_dict": ...} (default <ckpt>.consolidated)
  shardforge merge-sharded-fsdp-weights cfg.yml --format safetensors --output_path m.safetensors
  shardforge merge-sharded-fsdp-weights cfg.yml --format torch
  # print the plan (inputs, files, dtypes, bytes, free disk) and write nothing
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --dry_run
  python -m shardforge.cli.merge_sharded_fsdp_weights cfg.yml --output_path out
"""


def do_merge_sharded_fsdp_weights(
    config: str | Path,
    output_path: str | Path | None,
    override_args: list[str] | None = None,
    **options: Any,
) -> Path | str:
    """Load `config` (plus overrides) and run `merge_fsdp_weights` with `options` (the fields
    of `MergeRequest`, as the command line gives them: `steps="100,200"` is parsed there).

    The merge's byte copy gets a head start: it begins before torch is imported (torch and
    transformers take seconds to load), and the merge takes it over only when it is exactly
    what the merge would write (`shardforge.merge.overlap`). The start-up runs with a relaxed
    garbage collector (`shardforge.startup`)."""
    from shardforge.merge.overlap import head_start
    from shardforge.startup import relaxed_gc

    with relaxed_gc():  # no full collections while torch and transformers import
        cfg = load_config(config, override_args, "merge")
        if output_path is None and options.get("output_format", "hf") == "hf":
            output_path = default_output(cfg.output_dir)
        with head_start(cfg, output_path, options):
            from shardforge.merge.api import merge_fsdp_weights as merge

            return merge(cfg, output_path, **options)


def default_output(output_dir: str) -> str:
    """Where the command writes without --output_path: `<output_dir>/merged`, as Axolotl's
    `merge-sharded-fsdp-weights` does (an s3:// output_dir: the prefix beside its steps)."""
    out = f"{output_dir.rstrip('/')}/merged"
    log.info("output: %s (the default, as Axolotl; --output_path to choose)", out)
    return out


def merge_fsdp_weights(
    cfg: Any = None,
    output_path: str | Path | None = None,
    save_tokenizer: bool = True,
    *,
    checkpoint_dir: str | Path | None = None,
    **options: Any,
) -> Path | str:
    """Axolotl's `merge_fsdp_weights`, called either way Axolotl's scripts call it:

        merge_fsdp_weights(load_cfg("cfg.yml"), output_path="out", save_tokenizer=True)
        merge_fsdp_weights(checkpoint_dir="run/checkpoint-9/pytorch_model_fsdp_0",
                           output_path="out", remove_checkpoint_dir=False)   # Axolotl 0.21

    `cfg`: `shardforge.cli.config.load_cfg`'s result (or any mapping, `ShardforgeConfig` or
    config path); only the keys the merge reads are validated. Without a config, the first
    folder of `checkpoint_dir` and its parents holding a config.json is the run's (Axolotl
    saves the model's config in output_dir). The other keywords are the options of
    `shardforge merge-sharded-fsdp-weights` (`shardforge.merge.api.merge_fsdp_weights`).
    Returns the output path (an ``s3://`` output's URI as a str)."""
    from shardforge.merge.api import merge_fsdp_weights as merge

    if checkpoint_dir is None and isinstance(cfg, str | Path) and Path(cfg).is_dir():
        cfg, checkpoint_dir = None, cfg  # Axolotl 0.21: merge_fsdp_weights(checkpoint_dir, ...)
    if checkpoint_dir is not None:
        options["checkpoint"] = checkpoint_dir
        if cfg is None:
            cfg = _run_config(Path(checkpoint_dir))
    if cfg is None:
        raise TypeError("merge_fsdp_weights() needs the run's config (cfg) or checkpoint_dir")
    return merge(cfg, output_path, save_tokenizer, **options)


def _run_config(checkpoint_dir: Path) -> dict[str, str]:
    """A config naming the run of `checkpoint_dir`: the nearest folder (it or a parent, up to
    the run's output_dir) holding the model's config.json."""
    for folder in [checkpoint_dir, *checkpoint_dir.parents][:4]:
        if (folder / "config.json").is_file():
            return {"base_model": str(folder), "output_dir": str(folder)}
    raise CheckpointError(
        f"{checkpoint_dir}: no config.json in it or the folders above it; pass the run's "
        "config: merge_fsdp_weights(load_cfg('cfg.yml'), output_path=...)"
    )


@shardforge_command(
    "merge-sharded-fsdp-weights",
    epilog=EPILOG,
    params=[config_argument()],
    request=MergeRequest,
)
def command(config: str, overrides: list[str], **options: Any) -> str | None:
    """Merge the sharded FSDP checkpoint of CONFIG's run (the latest complete one under
    output_dir, or --checkpoint: DCP, per-rank DTensor files of verl / LMMs-Engine,
    torchtitan) into a complete Hugging Face model directory: safetensors weights + index,
    config.json, generation_config.json and tokenizer (or one file with --format). Memory
    stays at about one tensor per input; the output appears only when complete. The checkpoint
    and the output may be in object storage (s3://BUCKET/PREFIX, also an output_dir: s3://):
    credentials and endpoint from the AWS variables or the config's storage_options."""
    # --quiet hides the progress bar; the chosen checkpoint is still printed (on stderr)
    with quiet_libraries(options["quiet"]):  # --quiet: no transformers bars or warnings either
        out = do_merge_sharded_fsdp_weights(
            config, options.pop("output_path"), overrides, **options
        )
    return None if options["dry_run"] else f"{out}\n"


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
