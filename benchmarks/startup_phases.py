"""Where the merge's fixed start-up goes: the phases before its first byte is written.

Each repeat is a fresh process (cold imports, as a real merge starts) that times, in order:

1. the config: `shardforge.config` imported (pydantic, the schema) and the YAML loaded and
   validated, as the command line does before anything else (torch-free);
2. the head start's plan (`merge.overlap`): the checkpoint found, its `.metadata` read without
   torch, the output planned - when the console command's early copy can start copying
   (checked: torch is not imported yet);
3. `import torch`;
4. `import shardforge.merge.prepare` (the rest of shardforge's merge modules; whether
   `torch.distributed.checkpoint` came with them is printed: a streamed merge never uses it);
5. reading the checkpoint: finding it, the `.metadata` through the allow-list unpickler, the
   data files' bounds and tiling checks (`open_checkpoint`) - what a plan needs besides names;
6. the architecture: transformers' config and model classes imported, the model built on the
   meta device (`merge.prepare._architecture`);
7. the rest of what `merge.prepare.prepare` does: keys mapped and checked against the
   architecture, tied copies compared, the output plan (with the default shard size of the
   installed transformers).

The console command's copy starts after phase 2 and runs on its thread through phases 3 to 7
(the head start: docs/merge.md); phases 3 to 7 are what it hides, phases 1 and 2 come before any
byte moves. On a loaded machine the wall seconds of each phase move with the load.

    python benchmarks/startup_phases.py CFG CHECKPOINT_DIR --repeats 3
    python benchmarks/startup_phases.py .bench/llama-4GB-float32-2r/bench.yml \\
        .bench/llama-4GB-float32-2r/out/checkpoint-1/pytorch_model_fsdp_0
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, tempfile, time
t0 = time.perf_counter()
marks = {}
from shardforge.config import load_cfg
cfg = load_cfg(sys.argv[1], command="merge")
marks["config (torch-free)"] = time.perf_counter()
from shardforge.merge import overlap
scratch = tempfile.mkdtemp()
early = overlap._head_start_copy(cfg, os.path.join(scratch, "out"), {"checkpoint": sys.argv[2]})
assert "torch" not in sys.modules, "the head start imported torch"
marks["head start planned (torch-free)"] = time.perf_counter()
if early is not None:
    early.discard()
import shutil
shutil.rmtree(scratch, ignore_errors=True)
import torch
marks["import torch"] = time.perf_counter()
from shardforge.merge import prepare as api
from shardforge.merge.request import MergeRequest
from shardforge.merge.locate import merge_sources, pick_inputs
from shardforge.formats.registry import open_checkpoint
marks["import shardforge.merge.prepare"] = time.perf_counter()
dcp_imported = "torch.distributed.checkpoint" in sys.modules
request = MergeRequest(output_path=None, checkpoint=sys.argv[2], output_format="torch")
inputs = pick_inputs(sys.argv[2], request)
opened = open_checkpoint(inputs[0].kind, inputs[0].model_dir)
marks["checkpoint metadata"] = time.perf_counter()
sources = merge_sources(cfg, inputs)
config, expected = api._architecture(sources.config, cfg.trust_remote_code)
marks["transformers + meta architecture"] = time.perf_counter()
from shardforge.keymap.names import adapt_names
from shardforge.sinks.plan import default_max_shard_size, plan_output
named = adapt_names(inputs[0].adapter, inputs[0].model_dir, opened, config)
keymap, by_name = api._hf_sources(inputs[0], named, expected, sources.config)
from shardforge.merge.dtypes import output_rules, planned_specs
rules = output_rules(None, config, (), expected.keep)
specs, _ = planned_specs(((n, by_name[n].dtype, by_name[n].shape) for n in expected.saved_names),
                         rules)
plan_output(specs, default_max_shard_size(), expected.total_parameters)
marks["keys, checks, plan"] = time.perf_counter()
prev, out = t0, {}
for k, v in marks.items():
    out[k] = v - prev
    prev = v
out["total"] = prev - t0
out["planned early"] = early is not None
out["torch.distributed.checkpoint imported"] = dcp_imported
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: list[dict[str, float]] = []
    for _ in range(args.repeats):
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, args.config, args.checkpoint],
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]), file=sys.stderr)
    print(f"{'phase':<36}{'median s':>10}  runs")
    for phase in runs[0]:
        values = [r[phase] for r in runs]
        if isinstance(values[0], bool):
            print(f"{phase:<36}{values[0]!s:>10}")
            continue
        listed = ", ".join(f"{v:.2f}" for v in values)
        print(f"{phase:<36}{statistics.median(values):>10.2f}  {listed}")


if __name__ == "__main__":
    main()
