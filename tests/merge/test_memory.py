"""Memory: merging a checkpoint of about 620 MB (real fully_shard over 2 gloo ranks) keeps the
merge process's peak RSS growth far below the checkpoint size.

Bounds stated: the streaming merge's peak RSS minus the RSS before it (after imports and the
model code are loaded) stays below 15% of the checkpoint size, and the process's whole peak RSS
below the checkpoint size. With --verify, the growth stays below 15% of the checkpoint plus what
verification holds (it reads the checkpoint through torch's DCP reader, one tensor at a time:
the largest tensor and torch's copy of a stored chunk of it, at most 1.5 x the largest tensor
here). A merger that loads the model (as torch's dcp_to_torch_save or accelerate do) grows by
at least the checkpoint size.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.gate import Gate
from helpers.preloaded import run_on_preloaded_ranks
from helpers.tiny import make_config, make_tokenizer

# the checkpoint is written by gloo ranks; the merges run in subprocesses
pytestmark = pytest.mark.slow

# about 155M parameters, fp32: embeddings and lm_head 32000 x 1024, 8 decoder layers
BIG: dict[str, int] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}
VOCAB = 32000
GROWTH_BOUND = 0.15  # of the checkpoint size
LARGEST_TENSOR = VOCAB * BIG["hidden_size"] * 4  # embeddings / lm_head, fp32: 131 MB
VERIFY_BOUND = 1.5  # of the largest tensor: it and one of its two stored chunks

CHILD = r"""
import json, sys, time
import torch
import shardforge.merge.api
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from shardforge.config import load_cfg

# what does not depend on the checkpoint's size: imports, the model code, the tokenizer
cfg = load_cfg(sys.argv[1])
with torch.device("meta"):
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.base_model))
AutoTokenizer.from_pretrained(cfg.base_model)

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def measure(out, verify):
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    base = status("VmRSS")
    t0 = time.perf_counter()
    shardforge.merge.api.merge_fsdp_weights(cfg, out, verify=verify, quiet=True)
    seconds = time.perf_counter() - t0
    return {"baseline": base, "peak": status("VmHWM"), "seconds": seconds}

# the streaming merge alone, then merge + --verify (torch's reader: one tensor at a time)
result = {"merge": measure(sys.argv[2], False), "verify": measure(sys.argv[2] + "-verified", True)}
print(json.dumps(result))
"""


def save_big(rank: int, world_size: int, base: str, out: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")  # each rank materialises only its own shards
    torch.manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-0.05, 0.05)
    ckpt = Path(out) / "checkpoint-10"
    dcp.save(get_model_state_dict(model), checkpoint_id=ckpt / "model")
    if rank == 0:
        (ckpt / "trainer_state.json").write_text(json.dumps({"format": "shardforge", "step": 10}))


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with a ~620 MB checkpoint-10 and a config (cfg.yml) beside it."""
    root = tmp_path_factory.mktemp("big")
    base = root / "base"
    config = make_config("llama", vocab_size=VOCAB, **BIG)
    config.dtype = "float32"
    config.save_pretrained(base)
    make_tokenizer(320).save_pretrained(base)
    run = root / "run"
    run_on_preloaded_ranks(save_big, 2, str(base), str(run))  # imported once, not per rank
    (root / "cfg.yml").write_text(yaml.safe_dump({"base_model": str(base), "output_dir": str(run)}))
    return root


@pytest.mark.timeout(600)
def test_peak_memory_stays_far_below_checkpoint_size(big: Path, tmp_path: Path) -> None:
    run = big / "run"
    ckpt_bytes = sum(p.stat().st_size for p in (run / "checkpoint-10" / "model").iterdir())
    assert ckpt_bytes > 500e6

    cfg = big / "cfg.yml"
    out = tmp_path / "merged"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(cfg), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    both = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, mem in both.items():
        growth = mem["peak"] - mem["baseline"]
        print(
            f"{name}: checkpoint {ckpt_bytes / 1e6:.0f} MB, baseline {mem['baseline'] / 1e6:.0f} "
            f"MB, peak {mem['peak'] / 1e6:.0f} MB, growth {growth / 1e6:.0f} MB, "
            f"{mem['seconds']:.1f} s"
        )
    merge, verify = both["merge"], both["verify"]
    assert merge["peak"] - merge["baseline"] < GROWTH_BOUND * ckpt_bytes, merge
    assert merge["peak"] < ckpt_bytes, merge
    growth = verify["peak"] - verify["baseline"]
    assert growth < GROWTH_BOUND * ckpt_bytes + VERIFY_BOUND * LARGEST_TENSOR, verify
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert abs(written - ckpt_bytes) < 0.05 * ckpt_bytes  # all of it was written


def _tree_signature(root: Path) -> list[tuple[str, int, int]]:
    return [
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    ]


def _default_sigint() -> None:
    # a child of a background job (`make test &`, nohup, some CI runners) inherits an ignored
    # SIGINT, and Python then leaves Ctrl-C ignored: give the merge the terminal's default
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_merge_leaves_nothing(big: Path, tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM or Ctrl-C while writing: non-zero exit, no output, no temp directory, input
    untouched. A writer of the merge pauses once it has cast and written a block of tensor
    bytes into the hidden output's safetensors file (a test gate on `os.pwrite`): the signal
    comes mid-merge however fast the merge runs (the main thread cannot get past that block
    to publish), and the gate opens only once the signal is sent."""
    before = _tree_signature(big / "run")
    out = tmp_path / "merged"
    written = r"/\.merged\.tmp-[^/]+/model[^/]*\.safetensors$"  # the hidden output's weights
    gate = Gate(
        tmp_path / "gate",
        "os:pwrite",
        written,
        thread="MainThread|shardforge-cast|shardforge-direct",
    )
    cmd = [sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(big / "cfg.yml"),
           "--output_path", str(out), "--dtype", "bfloat16", "--verify"]  # fmt: skip
    with (tmp_path / "stderr").open("w+") as err:
        proc = subprocess.Popen(cmd, stderr=err, env=gate.env(), preexec_fn=_default_sigint)
        try:
            gate.wait(proc)
            # mid-merge: a partly written file in the hidden directory, nothing published
            assert list(tmp_path.glob(".merged.tmp-*/model*.safetensors")) and not out.exists()
            proc.send_signal(sig)
            gate.open()
            assert proc.wait(timeout=300) != 0
        finally:
            gate.open()
            if proc.poll() is None:
                proc.kill()
        err.seek(0)
        rest = err.read()
    assert "error: interrupted" in rest
    assert "Traceback" not in rest
    assert not out.exists()
    assert not list(tmp_path.glob(".merged.*"))
    assert _tree_signature(big / "run") == before
