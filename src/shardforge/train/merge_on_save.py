"""Merge while training (`merge_on_save`): each new checkpoint becomes a Hugging Face model.

On rank 0, once a checkpoint is complete, `MergeOnSave.submit` starts

    python -m shardforge.train.merge_on_save CONFIG --checkpoint output_dir/checkpoint-N
        --output_path output_dir/merged/checkpoint-N --overwrite --quiet

a separate process at low priority (`os.nice(NICENESS)`, one CPU thread, no GPU) that runs
`shardforge merge-sharded-fsdp-weights` (for a LoRA run: the PEFT adapter directory) while
training goes on. CONFIG is the run's resolved config, written to a temporary file. At most
`merge_on_save_max_running` merges run at once; later checkpoints wait in a queue (training
never waits for a merge). A failed merge is one warning line and never stops training. A
checkpoint that is queued or being merged is not pruned (save_total_limit) until its merge has
finished. At the end the run waits for every merge (`finish`), after its ranks are done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shardforge.config.schema import ShardforgeConfig
from shardforge.io.ranks import die_with_parent

log = logging.getLogger("shardforge")

MERGED_DIR = "merged"
NICENESS = 10  # added to the training process's niceness
PARENT_ENV = "SHARDFORGE_MERGE_PARENT_PID"
# what a merge must not inherit from a training rank: torchrun's variables (it would try to
# join the job) and the launcher's own (its error file belongs to the training ranks)
DIST_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
DIST_ENV_PREFIXES = ("TORCHELASTIC_", "SHARDFORGE_")


def merged_path(output_dir: Path, checkpoint: Path) -> Path:
    """Where the merge of `checkpoint` goes: output_dir/merged/checkpoint-N."""
    return output_dir / MERGED_DIR / checkpoint.name


def merge_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in DIST_ENV and not k.startswith(DIST_ENV_PREFIXES)
    }
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env[PARENT_ENV] = str(os.getpid())
    return env


def write_config(cfg: ShardforgeConfig, directory: Path) -> Path:
    """The run's resolved config (command-line overrides included) as a YAML file."""
    import yaml

    path = directory / "config.yml"
    data = cfg.model_dump(mode="json", exclude_defaults=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@dataclass
class _Running:
    checkpoint: Path
    output: Path
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    started: float


def _last_error(output: IO[bytes]) -> str:
    """The merge's `error:` line (else its last line), for a one-line report."""
    output.seek(0)
    lines = [ln.strip() for ln in output.read().decode("utf-8", "replace").splitlines()]
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if ln.startswith("error:")]
    found = errors[-1] if errors else (lines[-1] if lines else "no output")
    return found[:300]


class MergeOnSave:
    """The merges of one run (rank 0 only): a queue and at most `max_running` processes."""

    def __init__(self, cfg: ShardforgeConfig, output_dir: Path) -> None:
        self.cfg = cfg
        self.output_dir = output_dir
        self.max_running = cfg.merge_on_save_max_running
        self.queue: list[Path] = []
        self.running: list[_Running] = []
        self.merged: list[Path] = []
        self.failed: list[Path] = []
        self._tmp: Path | None = None

    def busy(self) -> frozenset[Path]:
        """Checkpoints that are queued or being merged (not to be pruned yet)."""
        return frozenset([*self.queue, *(r.checkpoint for r in self.running)])

    def submit(self, checkpoint: Path) -> None:
        """Merge `checkpoint` (complete) now, or once a merge slot is free."""
        self.queue.append(checkpoint)
        self.poll()
        if checkpoint in self.queue:
            log.info(
                "merge_on_save: %s waits for a merge slot (%d running)",
                checkpoint.name,
                len(self.running),
            )

    def poll(self) -> bool:
        """Report finished merges and start queued ones; True when a merge finished."""
        finished = [r for r in self.running if r.proc.poll() is not None]
        for run in finished:
            self.running.remove(run)
            self._report(run)
        while self.queue and len(self.running) < self.max_running:
            self._start(self.queue.pop(0))
        return bool(finished)

    def finish(self) -> None:
        """Wait until every submitted merge has finished (the end of the run)."""
        waiting = len(self.queue) + len(self.running)
        if waiting:
            log.info("merge_on_save: waiting for %d merge(s) to finish", waiting)
        while self.queue or self.running:
            self.poll()
            if self.running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.running[0].proc.wait(timeout=0.5)
        if self.merged or self.failed:
            log.info(
                "merge_on_save: %d checkpoint(s) merged into %s%s",
                len(self.merged),
                self.output_dir / MERGED_DIR,
                f", {len(self.failed)} failed" if self.failed else "",
            )
        self._cleanup()

    def terminate(self) -> None:
        """Stop every merge (training failed): nothing more is merged."""
        self.queue.clear()
        for run in self.running:
            with contextlib.suppress(OSError):
                run.proc.terminate()
        for run in self.running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.proc.wait(timeout=10)
            run.log.close()
        self.running.clear()
        self._cleanup()

    def _config(self) -> Path:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="shardforge-merge-on-save-"))
            write_config(self.cfg, self._tmp)
        return self._tmp / "config.yml"

    def _cleanup(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _start(self, checkpoint: Path) -> None:
        output = merged_path(self.output_dir, checkpoint)
        try:
            command = [
                sys.executable,
                "-m",
                "shardforge.train.merge_on_save",
                str(self._config()),
                "--checkpoint",
                str(checkpoint),
                "--output_path",
                str(output),
                "--overwrite",
                "--quiet",
            ]
            output_log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in _report)
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output_log,
                stderr=subprocess.STDOUT,
                env=merge_env(),
            )
        except OSError as exc:
            self.failed.append(checkpoint)
            log.warning(
                "warning: merge_on_save: cannot start the merge of %s (%s); training goes on",
                checkpoint.name,
                exc,
            )
            return
        self.running.append(_Running(checkpoint, output, proc, output_log, time.perf_counter()))

    def _report(self, run: _Running) -> None:
        seconds = time.perf_counter() - run.started
        code = run.proc.returncode
        if code == 0:
            self.merged.append(run.checkpoint)
            log.info(
                "merge_on_save: merged %s into %s (%.1f s)",
                run.checkpoint.name,
                run.output,
                seconds,
            )
        else:
            self.failed.append(run.checkpoint)
            log.warning(
                "warning: merge_on_save: merging %s failed (exit status %s): %s; training goes on",
                run.checkpoint.name,
                code,
                _last_error(run.log),
            )
        run.log.close()


def main(argv: list[str]) -> Any:
    """The merge process: lower its priority, then run `shardforge merge-sharded-fsdp-weights`."""
    import runpy

    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    parent = os.environ.get(PARENT_ENV)
    if parent:  # Linux: this merge ends (SIGTERM: it cleans up) when the training rank does
        die_with_parent(parent, signal.SIGTERM)
    sys.argv = ["shardforge", "merge-sharded-fsdp-weights", *argv]
    return runpy.run_module("shardforge", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
