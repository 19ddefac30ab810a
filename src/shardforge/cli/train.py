"""`shardforge train CONFIG`: FSDP2 training of the config's base model on its data sets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from shardforge.cli._common import config_argument, fire_entry, shardforge_command, spelled

EPILOG = """\b
Examples:
  shardforge train examples/tiny-llama.yml                    # 2 CPU ranks (gloo), or 1 per GPU
  shardforge train examples/tiny-llama.yml --max_steps 10 --learning_rate 1e-3
  shardforge train examples/tiny-llama.yml --launcher python  # one rank, in this process
  shardforge train cfg.yml --nproc_per_node 8 --nnodes 2 --node_rank 0 \\
      --rdzv_endpoint host0:29500 --rdzv_id job1              # run the same on every machine
  torchrun --nproc_per_node 4 -m shardforge.cli.train cfg.yml # under torchrun: used as given
  python -m shardforge.cli.train examples/tiny-llama.yml --max_steps 5
"""


def do_train(
    config: str | Path,
    override_args: list[str] | None = None,
    launcher: str = "torchrun",
    debug: bool = False,
    **launch: Any,
) -> int:
    """Check the config and train (see `shardforge.train.launch.do_train`)."""
    from shardforge.train.launch import LaunchOptions
    from shardforge.train.launch import do_train as launch_train

    opts = LaunchOptions(**{k: v for k, v in launch.items() if v is not None})
    return launch_train(config, override_args, launcher, opts, debug)  # type: ignore[arg-type]


@shardforge_command(
    "train",
    epilog=EPILOG,
    rank_logging=True,
    params=[
        config_argument(),
        click.Option(
            ["--launcher"],
            type=click.Choice(["torchrun", "python"]),
            default="torchrun",
            show_default=True,
            help="torchrun: start the ranks with torchrun; python: one rank in this process.",
        ),
        spelled("nproc_per_node", type=int, help="Ranks on this machine."),
        click.Option(["--nnodes"], help="Number of machines (or MIN:MAX), passed to torchrun."),
        spelled("node_rank", type=int, help="This machine's rank (torchrun)."),
        spelled("rdzv_endpoint", help="host:port of the rendezvous."),
        spelled("rdzv_backend", help="Rendezvous backend (default c10d)."),
        spelled("rdzv_id", help="Job id shared by all machines."),
        spelled("master_addr", help="Address of rank 0's machine (static)."),
        spelled("master_port", type=int, help="Port on rank 0's machine."),
        spelled("max_restarts", type=int, help="Restarts torchrun may make."),
    ],
)
def command(config: str, launcher: str, overrides: list[str], debug: bool, **launch: Any) -> None:
    """Train the base model of CONFIG with FSDP2. Outside torchrun it starts torchrun itself
    (one rank per GPU, or 2 CPU ranks on gloo); every problem the config has is reported
    before any rank starts. Checkpoints go to output_dir/checkpoint-<step>/."""
    do_train(config, overrides, launcher, debug, **launch)


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
