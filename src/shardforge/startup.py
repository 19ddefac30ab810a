"""A process's start-up, made lighter: what a command imports and allocates before its work.

Costs every merge, training rank and model command paid before it did anything, none of which
it needs (measured with `benchmarks/startup_phases.py` and `perf` on the 4 GB benchmark
checkpoint, 2-core machine):

- **The cyclic garbage collector during the imports.** torch and transformers create a few
  hundred thousand objects at import; with Python's default thresholds the collector ran six
  full collections over that growing heap, 0.6-0.9 s of CPU before the first byte.
  `relaxed_gc` raises the youngest generation's threshold for the block (`START_GC_THRESHOLD`):
  no full collection runs during the imports, the few cycles they leave are collected later.
- **Optional packages transformers imports at module level when installed** (`DEFERRED`):
  torchao (its quantizer's serialization helper) and scipy (the Hungarian matcher of the
  object-detection losses) came with `transformers.modeling_utils`: +46 MB of peak RSS and about
  0.5 s of CPU; building or training a model uses neither. `import_model_code` imports
  transformers' model code once, with those packages reported unavailable while it does, then
  restores every availability check and gives each module that skipped a name a stand-in that
  imports the real one when first called (`LAZY`): what those modules do is unchanged, the
  packages load only if used (a torchao quantization or QAT imports torchao itself).
- **bitsandbytes, imported by peft whether used or not** (`LAZY_PACKAGES`): `peft.helpers`
  imports it at module level, and bitsandbytes imports torch's inductor and networkx to
  register its kernels: about 2.4 s of CPU in every training rank and model command, of a
  LoRA that never quantizes. `lazy_packages` registers it as a module that loads on first use
  (`_LazyPackage`: an `import bitsandbytes` anywhere gets
  it at once, the first attribute read (a QLoRA, an 8-bit optimizer) runs the real import.

Torch-free to import (the merge's head start runs before torch: `merge.overlap`); the bottom
layer, so every command's entry can use it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

# the youngest generation's threshold during the start-up (Python's default: 700)
START_GC_THRESHOLD = 20_000
# transformers' availability check -> the names modules import from that package when it is
# available (module attribute -> the module it comes from): stand-ins import them when called
LAZY: dict[str, dict[str, str]] = {
    "is_torchao_available": {
        "flatten_tensor_state_dict": "torchao.prototype.safetensors.safetensors_support",
    },
    "is_scipy_available": {"linear_sum_assignment": "scipy.optimize"},
}
DEFERRED = tuple(LAZY)
# installed packages a library imports at module level, loaded only when first used
LAZY_PACKAGES = ("bitsandbytes",)
MODEL_CODE = "transformers.modeling_utils"


@contextlib.contextmanager
def relaxed_gc() -> Iterator[None]:
    """Within the block the youngest generation is collected every `START_GC_THRESHOLD`
    allocations (no full collection while torch and transformers import); restored after."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], START_GC_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def lazy_packages() -> None:
    """Each of `LAZY_PACKAGES` that is installed and not imported yet becomes a module that
    runs its real import at the first attribute read (see the module docstring)."""
    for name in LAZY_PACKAGES:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None:
            sys.modules[name] = _LazyPackage(name, spec)


class _LazyPackage(types.ModuleType):
    """An installed package not run yet: `import` returns it, and what the import system and
    `inspect` read of every module (`__spec__`, `__file__`, `__loader__`) is there; any other
    attribute read (`__path__` too: a submodule's import) imports the real package first."""

    def __init__(self, name: str, spec: Any) -> None:
        super().__init__(name)
        self.__spec__ = spec
        self.__file__ = spec.origin
        self.__loader__ = spec.loader
        self.__package__ = name

    def __getattr__(self, attr: str) -> Any:  # a name this stand-in does not hold
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        real = importlib.import_module(name)  # the real import, once
        vars(self).update(vars(real))  # later reads through this stand-in find it all
        return getattr(real, attr)


def _unavailable(*_args: Any, **_kwargs: Any) -> bool:
    return False


def _stand_in(name: str, source: str) -> Callable[..., Any]:
    """`source.name`, imported when first called."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(source), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"{source}.{name}, imported when first called (`shardforge.startup`)."
    return call


def import_model_code() -> None:
    """Import `transformers.modeling_utils` without the packages of `DEFERRED` (see the module
    docstring); nothing when it is imported already."""
    if MODEL_CODE in sys.modules:
        return
    import transformers.utils
    import transformers.utils.import_utils as import_utils

    holders = (import_utils, transformers.utils)
    saved = {n: getattr(import_utils, n) for n in DEFERRED if hasattr(import_utils, n)}
    before = set(sys.modules)
    try:
        for name in saved:
            for holder in holders:
                setattr(holder, name, _unavailable)
        importlib.import_module(MODEL_CODE)
    finally:
        for name, check in saved.items():
            for holder in holders:
                setattr(holder, name, check)
        _restore(sorted(set(sys.modules) - before), saved)


def _restore(imported: list[str], saved: dict[str, Any]) -> None:
    """In each of the `imported` transformers modules: the real availability checks back, and
    a stand-in for each name it skipped because a check said its package was missing."""
    for module_name in imported:
        module = sys.modules.get(module_name)
        if module is None or not module_name.startswith("transformers"):
            continue
        space = vars(module)
        for check, real in saved.items():
            if space.get(check) is not _unavailable:
                continue
            space[check] = real
            for name, source in LAZY[check].items():
                if name not in space:
                    space[name] = _stand_in(name, source)
