"""Memory: streaming full tensors out of rank files (~265 MB written by 2 real gloo ranks) grows
the reading process's peak RSS by about one tensor, not by the checkpoint size.

Bound stated: peak RSS during `plan_rank_files` + reading every key as the merge does, minus the RSS
before (after imports), stays below 1.25 x the largest tensor + 32 MB, and below 50% of the
checkpoint. Loading the files (torch.load) would grow it by at least the checkpoint size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.dist import run_on_ranks
from helpers.tiny import make_config

# the rank files are written by gloo ranks
pytestmark = pytest.mark.slow

# about 66M parameters, fp32; the largest tensors (embeddings, lm_head) are 32000 x 512
BIG = {
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
VOCAB = 32000

CHILD = r"""
import json, math, sys
from shardforge.formats.rankfiles.source import RankFileSource
from shardforge.io.copy import ReadCache
from shardforge.formats.rankfiles import plan_rank_files

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
    f.write("5")
base = status("VmRSS")
total = largest = 0
reader = ReadCache()
for key, plan in plan_rank_files(sys.argv[1]).items():
    tensor = RankFileSource(plan).read(reader)
    n = tensor.numel() * tensor.element_size()
    total, largest = total + n, max(largest, n)
    assert math.isfinite(float(tensor.view(-1)[-1]))  # the last element was read
    del tensor
reader.close()
print(json.dumps({"base": base, "peak": status("VmHWM"), "total": total, "largest": largest}))
"""


def save_big(rank: int, world_size: int, config_dir: str, out: str) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")  # each rank materialises only its own shards
    torch.manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    torch.save(model.state_dict(), f"{out}/model_world_size_{world_size}_rank_{rank}.pt")


def test_reading_every_tensor_peaks_at_about_one_tensor(tmp_path: Path) -> None:
    config_dir = tmp_path / "config"
    make_config("llama", VOCAB, **BIG).save_pretrained(config_dir)
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    run_on_ranks(save_big, 2, str(config_dir), str(ranks))
    on_disk = sum(p.stat().st_size for p in ranks.iterdir())
    assert on_disk > 250e6

    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(ranks)], capture_output=True, text=True, check=True
    )
    m = json.loads(out.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["base"]
    assert m["largest"] == VOCAB * 512 * 4 and m["total"] > 250e6
    assert growth < 1.25 * m["largest"] + 32e6, (growth, m)
    assert growth < 0.5 * m["total"], (growth, m)
