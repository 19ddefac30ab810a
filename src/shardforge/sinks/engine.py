"""`--engine transformers`: the literal path (meta-device model, `to_empty`, `dcp.load`,
`save_pretrained`). It holds the whole model in memory; the default engine streams. Its
integrity manifest hashes the files save_pretrained wrote, once written (the one output whose
weights are read again for it: the safetensors library writes them, with no bytes handed out).

Each tensor is loaded in the dtype the plan gives it (the dtype it is stored in with
``--dtype as_saved``, the cast one otherwise), so a mixed-dtype checkpoint comes out as the
streaming engine writes it, not in the model's one dtype."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardforge.formats.dcp.reader import load_checked
from shardforge.io.publish import atomic_directory
from shardforge.sinks.base import Output, Progress, Sink, WriteOptions, verified_line
from shardforge.sinks.hf_dir import HfDirectorySink, write_companions
from shardforge.sinks.manifest import new_hashes, write_manifest

log = logging.getLogger("shardforge")


def merge_with_transformers(
    config: Any,
    model_dir: Path,
    to_hf: Mapping[str, str],
    dtypes: Mapping[str, torch.dtype],
    out: Path,
    max_shard_size: int | str,
    trust_remote_code: bool,
) -> None:
    """Load the DCP at `model_dir` into the model built from `config` (checkpoint key ->
    name: `to_hf`; name -> dtype: `dtypes`, the model's own for the rest) and save it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    model.to_empty(device="cpu")
    sd = model.state_dict()
    target = {
        key: torch.empty(sd[hf].shape, dtype=dtypes.get(hf, sd[hf].dtype))
        for key, hf in to_hf.items()
    }
    load_checked(target, model_dir, no_dist=True)
    model.load_state_dict({hf: target[key] for key, hf in to_hf.items()}, strict=False, assign=True)
    model.tie_weights()  # tied parameters share one storage again
    model.save_pretrained(out, max_shard_size=max_shard_size)


class TransformersSink(Sink):
    """`--engine transformers` (see the module docstring): an HF directory as save_pretrained
    writes it; verified like the streaming engine's."""

    name = "hf"

    def __init__(
        self, model_dir: Path, to_hf: Mapping[str, str], max_shard_size: int | str, trust: bool
    ) -> None:
        self.model_dir, self.to_hf = model_dir, to_hf
        self.max_shard_size, self.trust = max_shard_size, trust

    def write(self, output: Output, out: Path, options: WriteOptions) -> None:
        assert output.companions is not None
        dtypes = {t.spec.name: t.spec.dtype for _, t in output.plan.tensors()}
        with atomic_directory(out, options.overwrite, model_only=options.model_only) as tmp:
            merge_with_transformers(
                output.companions.config,
                self.model_dir,
                self.to_hf,
                dtypes,
                tmp,
                self.max_shard_size,
                self.trust,
            )
            write_companions(output.companions, output.dtype, tmp)
            if options.verify:
                n = self.verify(output, tmp)
                log.info("%s", verified_line(n, output))
            # save_pretrained writes through the safetensors library, which gives no bytes to
            # hash on their way: this path (the whole model in memory already) hashes its
            # files once written
            write_manifest(tmp, new_hashes(options.manifest_hash), output.sources.values())

    def verify(self, output: Output, location: Path, progress: Progress | None = None) -> int:
        return HfDirectorySink().verify(output, location, progress)

    def files(self, output: Output, out: Path) -> list[tuple[str, int | None, int | None]]:
        return HfDirectorySink().files(output, out)
