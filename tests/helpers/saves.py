"""Two saves of one model's shapes with other values, as a checkpoint replaced by a later save
looks: the torture cases of inputs that change under a merge (`io.pins`, `--resume`).

    saves = two_saves(tmp_path)      # saves.base (config + tokenizer), saves.a, saves.b
    replace_files(saves.b, saves.a)  # a's files become b's (new inodes, same sizes)

Each save is a DCP folder written by `dcp.save(no_dist=True)` in this process (no ranks):
`.metadata` and one `__0_0.distcp` of about 2.5 MB (above `io.mirror.DOWNLOAD_LIMIT`: in a
store, read by ranged GETs). The two folders hold the same file names and sizes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers.tiny import make_model

# a vocabulary large enough for a data file above 1 MiB (embeddings and lm_head: 2 x 1 MiB)
VOCAB = 4096


@dataclass(frozen=True)
class Saves:
    base: Path
    a: Path
    b: Path

    def config(self, **more: Any) -> dict[str, Any]:
        """A merge config for these saves."""
        return {"base_model": str(self.base), "output_dir": "unused", **more}


def two_saves(root: Path) -> Saves:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    base = make_model(root / "base", "llama", vocab_size=VOCAB)
    state = AutoModelForCausalLM.from_pretrained(base).state_dict()
    a, b = root / "a", root / "b"
    dcp.save({k: v.clone() for k, v in state.items()}, checkpoint_id=a, no_dist=True)
    dcp.save({k: v + 1.0 for k, v in state.items()}, checkpoint_id=b, no_dist=True)
    sizes = [{p.name: p.stat().st_size for p in d.iterdir()} for d in (a, b)]
    assert sizes[0] == sizes[1], sizes  # another save of the same shapes: the same sizes
    assert (a / "__0_0.distcp").read_bytes() != (b / "__0_0.distcp").read_bytes()
    return Saves(base, a, b)


def replace_files(source: Path, folder: Path, names: tuple[str, ...] | None = None) -> None:
    """Each file of `source` (or only `names`) put in place of the one in `folder`, renamed
    over it (a new inode, as a later save writes it)."""
    for path in sorted(source.iterdir()):
        if names is None or path.name in names:
            part = folder / f".{path.name}.new"
            shutil.copyfile(path, part)
            os.replace(part, folder / path.name)
