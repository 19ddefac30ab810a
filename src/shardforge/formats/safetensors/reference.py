"""A safetensors file's independent reader for `--verify`: the `safetensors` library
(``safe_open``), never shardforge's own header parser."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shardforge.errors import MergeError
from shardforge.formats.base import ReferenceReader, StoredTensor
from shardforge.formats.reference import safetensors_file, short_reason, verify_failed


@dataclass
class SafetensorsReference(ReferenceReader):
    """One safetensors file (a base model's shard, an adapter) read by the `safetensors`
    library (``safe_open``), never by shardforge's header parser. The file has no checksums."""

    path: Path  # `StoredTensor.directory` of a safetensors tensor is its file

    def check_crcs(self, keys: set[str]) -> None:
        return None

    def load(self, wanted: Sequence[StoredTensor]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        try:
            keys = [s.key for s in wanted]
            with (
                safetensors_file(self.path, keys) as local,
                safe_open(str(local), framework="pt") as f,
            ):
                present = set(f.keys())
                for s in wanted:
                    if s.key not in present:
                        raise verify_failed(
                            s.key, self.path, "is missing for the safetensors library"
                        )
                    tensor = f.get_tensor(s.key)
                    if tensor.dtype != s.dtype or tuple(tensor.shape) != tuple(s.shape):
                        raise verify_failed(
                            s.key,
                            self.path,
                            f"is {tensor.dtype} {list(tensor.shape)} for the safetensors "
                            f"library but {s.dtype} {list(s.shape)} for the merge",
                        )
                    out[s.key] = tensor
        except MergeError:
            raise
        except Exception as exc:
            raise MergeError(
                f"verification failed: the safetensors library cannot read {self.path} "
                f"({short_reason(exc)})"
            ) from None
        return out
