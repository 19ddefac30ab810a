"""`shardforge quantize CONFIG`: torchao post-training quantization of the trained model
(Axolotl's `quantize`, with its flags), written to OUTPUT_DIR/quantized as a Hugging Face folder
that transformers loads; the weights' size before and after printed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardforge.cli._common import config_argument, fire_entry, run_on_model, shardforge_command
from shardforge.use.request import QuantizeRequest

EPILOG = """\b
Examples:
  # the merged model, int8 weights, into outputs/quantized (as Axolotl's quantize)
  shardforge quantize cfg.yml --base_model outputs/merged --output_dir outputs
  # the run's own model (its full-model save, else its latest checkpoint merged on the fly)
  shardforge quantize cfg.yml --quantize-embedding
  # int4 weights in groups of 64 (a CUDA GPU), activations int8 as they come
  shardforge quantize cfg.yml --base-model outputs/merged --weight-dtype int4 --group-size 64
  shardforge quantize cfg.yml --base_model outputs/merged --activation_dtype int8
  python -m shardforge.cli.quantize cfg.yml --base_model outputs/merged
"""


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def do_quantize(config: str | Path, override_args: list[str] | None = None, **options: Any) -> Any:
    """Load `config` (plus overrides) and quantize (`options`: the fields of QuantizeRequest)."""
    from shardforge.use.quantize import quantize_model

    return run_on_model(quantize_model, config, override_args, options)


@shardforge_command("quantize", epilog=EPILOG, params=[config_argument()], request=QuantizeRequest)
def command(config: str, overrides: list[str], **options: Any) -> str:
    """Quantize the model CONFIG's run trained with torchao (--base_model DIR or --model_dir
    DIR, --checkpoint / --step merged on the fly, else the run's own) and write it to
    OUTPUT_DIR/quantized (--output_dir, else the config's output_dir): int8 weights per output
    channel (--weight_dtype int8, the default) or int4 in groups (a CUDA GPU),
    --activation_dtype int8 for dynamic activations, --quantize_embedding for the input
    embedding. transformers loads the folder as it is (TorchAoConfig in config.json)."""
    out = do_quantize(config, overrides, **options)
    ratio = out.size_after / out.size_before if out.size_before else float("nan")
    return (
        f"quantized: {out.path}\n"
        f"weights: {_size(out.size_before)} -> {_size(out.size_after)} ({ratio:.2f}x)\n"
    )


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
