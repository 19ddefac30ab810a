"""The README's story on the shipped example, at a smaller scale: train (2 ranks), merge with the
real CLI, load with transformers, generate (cicd/demo.sh runs the full-size version)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import torch
from train_helpers import ROOT, read_metrics, run_train, train_env

EXAMPLE = ROOT / "examples" / "tiny-llama.yml"


def test_train_merge_load_generate(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    out, merged = tmp_path / "out", tmp_path / "merged"
    run_train(EXAMPLE, "--output_dir", str(out), "--max_steps", "6", "--save_steps", "3", nproc=2)
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-3", "checkpoint-6"]
    assert len(read_metrics(out)) == 6

    merge = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardforge",
            "merge-sharded-fsdp-weights",
            str(EXAMPLE),
            "--output_dir",
            str(out),
            "--output_path",
            str(merged),
        ],
        capture_output=True,
        text=True,
        env=train_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert merge.returncode == 0, merge.stderr

    # the merged model is exactly the trained one (as stored in the last DCP checkpoint)
    model = AutoModelForCausalLM.from_pretrained(merged)
    trained = AutoModelForCausalLM.from_pretrained(ROOT / "examples" / "tiny-llama" / "base")
    state = trained.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(out / "checkpoint-6" / "model"), no_dist=True)
    trained.load_state_dict(state)
    ids = torch.tensor([[40, 50, 60, 70, 80]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, trained(ids).logits)

    gen = subprocess.run(
        [
            sys.executable,
            "examples/generate.py",
            str(merged),
            "--prompt",
            "The robot",
            "--max_new_tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        env=train_env(),
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    assert gen.stdout.startswith("The robot") and len(gen.stdout.strip()) > len("The robot")
