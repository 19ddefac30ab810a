"""The checkpoint saves of one run: synchronous or in the background (`async_save`), rotation
(`save_total_limit`) and the merges of `merge_on_save`.

    saver = Saver(cfg, output_dir, rt)   every rank, before the first step
    saver.save(state, model, opt, final) at each save step (every rank)
    saver.poll()                         after every step (rank 0 publishes a finished
                                         background save, reports and starts merges)
    saver.close() / saver.abort()        end of training (every rank) / a failed run
    saver.finish()                       after the process group is gone: wait for merges

With `async_save` at most one save is in flight: the next save (and the end of training) first
waits for the previous one. A checkpoint is pruned only after a newer one is complete, and not
while it is queued for or being merged.
"""

from __future__ import annotations

import logging
from pathlib import Path, PurePath

import torch

from shardforge.config.schema import ShardforgeConfig
from shardforge.train import checkpointing as ckpt
from shardforge.train.merge_on_save import MergeOnSave
from shardforge.train.remote_run import RemoteOutput
from shardforge.train.runtime import Runtime

log = logging.getLogger("shardforge")


class Saver:
    """Writes a run's checkpoints and hands every complete one to merge_on_save."""

    def __init__(self, cfg: ShardforgeConfig, output_dir: Path | RemoteOutput, rt: Runtime) -> None:
        self.cfg = cfg
        self.output_dir = output_dir
        self.rt = rt
        self.adapter_only = cfg.adapter is not None
        # every rank creates the background writes' groups at the same point
        self.groups = ckpt.save_groups() if cfg.async_save else None
        self.pending: ckpt.PendingSave | None = None
        self.pending_final = False
        self.merges = None
        self.keep: frozenset[PurePath] = frozenset()  # never pruned (load_best_model_at_end)
        if cfg.merge_on_save and rt.is_main:
            assert isinstance(output_dir, Path), "merge_on_save: local output_dir only (preflight)"
            self.merges = MergeOnSave(cfg, output_dir)
        full = cfg.fsdp.state_dict_type == "FULL_STATE_DICT"
        if rt.is_main and cfg.merge_on_save == "final" and full:
            log.warning(
                "warning: merge_on_save: final does nothing with fsdp.state_dict_type: "
                "FULL_STATE_DICT (the final save already is a Hugging Face model)"
            )

    def save(
        self,
        state: ckpt.TrainerState,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        final: bool,
    ) -> None:
        """Save checkpoint-<state.step> (every rank)."""
        if self.groups is None:
            keeps = self.merges is not None or self.keep
            limit = None if keeps else self.cfg.save_total_limit  # else: pruned by _prune
            path = ckpt.save_checkpoint(
                self.output_dir, state, model, optimizer, limit, adapter_only=self.adapter_only
            )
            if self.rt.is_main:
                self._completed(path, final)
            return
        self._complete_pending()  # at most one save in flight
        assert isinstance(self.output_dir, Path), "async_save: local output_dir only (preflight)"
        self.pending = ckpt.start_async_save(
            self.output_dir, state, model, optimizer, self.groups, self.adapter_only
        )
        self.pending_final = final
        if self.rt.is_main:
            log.info("saving checkpoint-%d in the background", state.step)

    def poll(self) -> None:
        """After a step: rank 0 publishes a background save that has finished, and reports
        and starts merges. No collectives."""
        if not self.rt.is_main:
            return
        if self.pending is not None and self.pending.done():
            self._complete_pending()
        if self.merges is not None and self.merges.poll():
            self._prune()  # checkpoints kept for their merge may go now

    def close(self) -> None:
        """The end of training (every rank): the last save is complete."""
        self._complete_pending()

    def abort(self) -> None:
        """A failed run: stop the merges (the background writes are not waited for)."""
        if self.merges is not None:
            self.merges.terminate()

    def finish(self) -> None:
        """After the ranks are done (rank 0): wait for every merge, then prune."""
        if self.merges is not None:
            self.merges.finish()
            self._prune()

    def _complete_pending(self) -> None:
        pending, final = self.pending, self.pending_final
        if pending is None:
            return
        assert isinstance(self.output_dir, Path)
        path = ckpt.complete_async_save(self.output_dir, pending)
        self.pending = None
        if path is not None:
            self._completed(path, final)

    def _completed(self, path: PurePath, final: bool) -> None:
        """Rank 0: `path` is complete: merge it (merge_on_save), then rotate."""
        if self.merges is not None and (self.cfg.merge_on_save is True or final):
            assert isinstance(path, Path)
            self.merges.submit(path)
        self._prune()

    def _prune(self) -> None:
        busy = self.merges.busy() if self.merges is not None else frozenset()
        keep = frozenset(Path(p) for p in (*busy, *self.keep))
        for path in ckpt.prune(self.output_dir, self.cfg.save_total_limit, keep):
            log.info("deleted %s (save_total_limit %s)", path.name, self.cfg.save_total_limit)
