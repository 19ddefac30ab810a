"""`torch_compile`: each transformer block compiled in place, and what the compiler did.

    compile_blocks(blocks, cfg)   block.compile(...) for every block (after activation
                                  checkpointing, before fully_shard), when torch_compile is on
    CompileWatch.of(cfg, rt)      around each step: the compile time once (after the first
                                  step), a warning when a later step compiled again

A block is compiled in place (`nn.Module.compile`, as accelerate's regional compilation and
torchtitan do): the module keeps its class, parameters and names, and FSDP2's hooks stay on it
(`torch.compile(module)` would return a wrapper that bypasses them). The decoder's own forward
(mask building from the packed position ids, rotary embeddings), the output head and the loss
run eagerly between the compiled blocks. Every step has the same shapes (micro_batch_size x
sequence_len, packed or padded), so the blocks' graphs are compiled in the first step and reused
by every later one; a step that compiles again (a shape or a guard that changed) is logged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardforge.config.schema import ShardforgeConfig
from shardforge.train.runtime import Runtime

log = logging.getLogger("shardforge")

DEFAULT_BACKEND = "inductor"


def compile_enabled(cfg: ShardforgeConfig) -> bool:
    """`torch_compile: true`, or `auto` (Axolotl: on with torch >= 2.5.1, which train requires)."""
    return cfg.torch_compile in (True, "auto")


def compile_kwargs(cfg: ShardforgeConfig) -> dict[str, Any]:
    """The keywords of `nn.Module.compile` the config asks for."""
    kwargs: dict[str, Any] = {"backend": cfg.torch_compile_backend or DEFAULT_BACKEND}
    if cfg.torch_compile_mode is not None:
        kwargs["mode"] = cfg.torch_compile_mode
    if cfg.torch_compile_options:
        kwargs["options"] = dict(cfg.torch_compile_options)
    return kwargs


def compile_blocks(blocks: Iterable[nn.Module], cfg: ShardforgeConfig) -> int:
    """Compile each block in place when torch_compile is on; the number compiled."""
    if not compile_enabled(cfg):
        return 0
    kwargs = compile_kwargs(cfg)
    count = 0
    for block in blocks:
        block.compile(**kwargs)
        count += 1
    described = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    log.info("torch.compile: %d transformer blocks compiled in place (%s)", count, described)
    return count


def dynamo_ready() -> bool:
    """torch._dynamo imports (its counters are what the watch reads)."""
    try:
        import torch._dynamo.utils  # noqa: F401
    except ImportError:
        return False
    return True


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process (forward and backward)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


@dataclass
class CompileWatch:
    """Rank 0 says when compiling starts (the first step, the first evaluation: each is a
    long silence otherwise) and how long it took, and warns (once) when a later step compiled
    new graphs: each one costs a compile, and a recompile every step means a value the
    compiled code depends on changes from step to step. Inactive (nothing read, nothing
    imported) unless torch_compile is on and torch._dynamo imports."""

    active: bool
    is_main: bool
    expect: str = ""  # how long the first compile takes, where known
    graphs: int = 0  # graphs when this step started
    steps: int = 0
    warned: bool = False
    evaluated: bool = False

    @classmethod
    def of(cls, cfg: ShardforgeConfig, rt: Runtime) -> CompileWatch:
        if not compile_enabled(cfg) or not dynamo_ready():
            return cls(False, rt.is_main)
        backend = compile_kwargs(cfg)["backend"]
        on_cpu = backend == "inductor" and rt.device.type == "cpu"
        return cls(True, rt.is_main, "; about 45 s on a CPU with inductor" if on_cpu else "")

    def before_step(self) -> None:
        """A step starts (graphs compiled since the last step, by an evaluation, do not count)."""
        if not self.active:
            return
        if self.steps == 0 and self.is_main:
            log.info("torch.compile: compiling the transformer blocks (first step%s)", self.expect)
        self.graphs = compiled_graphs()

    def after_step(self, step: int) -> None:
        if not self.active:
            return
        graphs = compiled_graphs()
        self.steps += 1
        if self.steps == 1:
            if self.is_main:
                log.info(
                    "torch.compile: %.1f s compiling %d graph(s) in the first step (later steps "
                    "reuse them)",
                    compile_seconds(),
                    graphs,
                )
        elif graphs > self.graphs and not self.warned and self.is_main:
            self.warned = True
            log.warning(
                "warning: torch.compile compiled %d more graph(s) at step %d (a shape or value "
                "the compiled blocks depend on changed; TORCH_LOGS=recompiles says which)",
                graphs - self.graphs,
                step,
            )

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Around an evaluation: the first one compiles the blocks' eval-mode graphs."""
        first = self.active and not self.evaluated and self.is_main
        self.evaluated = self.evaluated or self.active
        if not first:
            yield
            return
        log.info("torch.compile: compiling the transformer blocks for evaluation (first one)")
        graphs, seconds = compiled_graphs(), compile_seconds()
        yield
        log.info(
            "torch.compile: %.1f s compiling %d graph(s) in the first evaluation (later "
            "evaluations reuse them)",
            compile_seconds() - seconds,
            compiled_graphs() - graphs,
        )
