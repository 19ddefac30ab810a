"""The merge's lighter start-up (`shardforge.startup`): transformers' model code imported without the
optional packages a meta-device build never uses, every name those modules skipped still there
(a stand-in importing the real one when called), and the collector relaxed while torch and
transformers import."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import shardforge
from shardforge import startup

# In a fresh process (this one has transformers' model code imported already): the merge's
# meta-device build after `import_model_code`, then what was imported and what each module holds.
CHILD = r"""
import ast, json, sys
import numpy as np
from shardforge.startup import LAZY, import_model_code, lazy_packages
lazy_packages()
from shardforge.merge.check import build_expected
from transformers import AutoConfig
import_model_code()
expected = build_expected(AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=128), False)
import transformers.utils.import_utils as iu
out = {"modules": [m for m in ("torchao", "scipy") if m in sys.modules], "missing": [],
       "checks": {c: getattr(iu, c)() for c in LAZY}, "built": len(expected.shapes)}

# every name a transformers module binds under `if <a deferred check>():` at module level
def statements(body):
    for st in body:
        yield st
        if isinstance(st, (ast.If, ast.Try)):
            yield from statements(st.body + st.orelse + getattr(st, "finalbody", []))
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None) or ""
    if not name.startswith("transformers") or not path.endswith(".py"):
        continue
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        test = node.test if isinstance(node, ast.If) else None
        calls = [getattr(c.func, "id", None) for c in ast.walk(test) if isinstance(c, ast.Call)] if test else []
        check = next((c for c in calls if c in LAZY), None)
        if check is None:
            continue
        if node.orelse:  # the lean import took the other branch: not the same module
            out["missing"].append(f"{name}: an else branch under {check}")
        if vars(module).get(check) is not getattr(iu, check):
            out["missing"].append(f"{name}.{check} (not the real check)")
        for sub in statements(node.body):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                bound = [a.asname or a.name.split(".")[0] for a in sub.names]
            elif isinstance(sub, (ast.Assign, ast.FunctionDef, ast.ClassDef)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub]
                bound = [getattr(t, "id", getattr(t, "name", "")) for t in targets]
            else:
                continue
            out["missing"] += [f"{name}.{b}" for b in bound if b and b not in vars(module)]
loss = sys.modules.get("transformers.loss.loss_for_object_detection")
if loss is not None and out["checks"]["is_scipy_available"]:
    cost = np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
    rows, cols = loss.linear_sum_assignment(cost)
    out["assignment"] = [rows.tolist(), cols.tolist()]
    out["scipy_after_call"] = "scipy" in sys.modules
import peft.helpers  # peft imports bitsandbytes at module level: registered, not loaded
out["bnb"] = [type(peft.helpers.bnb).__name__, "bitsandbytes.functional" in sys.modules]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_model_code_imports_without_the_packages_a_meta_build_never_uses() -> None:
    """A fresh process (about 5 s: torch and transformers import)."""
    src = str(Path(shardforge.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["built"] > 0
    assert out["modules"] == []  # neither torchao nor scipy came with the model code
    assert out["missing"] == []  # every skipped name has its stand-in; every check is real
    if importlib.util.find_spec("bitsandbytes") is not None:
        assert out["bnb"] == ["_LazyPackage", False]  # peft holds it; nothing of it ran
    installed = {"is_torchao_available": "torchao", "is_scipy_available": "scipy"}
    for check, package in installed.items():  # the checks report what is installed again
        assert out["checks"][check] == (importlib.util.find_spec(package) is not None)
    if "assignment" in out:  # the stand-in is scipy's own, imported when called
        assert out["assignment"] == [[0, 1, 2], [1, 0, 2]]
        assert out["scipy_after_call"]


def test_import_model_code_does_nothing_once_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    if startup.MODEL_CODE not in sys.modules:  # (as in any process that built a model)
        monkeypatch.setitem(sys.modules, startup.MODEL_CODE, types.ModuleType(startup.MODEL_CODE))
    before = set(sys.modules)
    startup.import_model_code()
    assert set(sys.modules) == before


def test_relaxed_gc_raises_the_threshold_for_the_block_only() -> None:
    before = gc.get_threshold()
    with startup.relaxed_gc():
        assert gc.get_threshold()[0] >= startup.START_GC_THRESHOLD
        assert gc.get_threshold()[1:] == before[1:]
    assert gc.get_threshold() == before


def test_lazy_packages_load_at_the_first_attribute_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package of `LAZY_PACKAGES` is importable at once and runs its code at first use."""
    package = tmp_path / "sf_lazy_probe"
    package.mkdir()
    marker = tmp_path / "ran"
    (package / "__init__.py").write_text(
        f"open({str(marker)!r}, 'a').write('x')\nVALUE = 7\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(startup, "LAZY_PACKAGES", ("sf_lazy_probe", "sf_not_installed_probe"))
    monkeypatch.delitem(sys.modules, "sf_lazy_probe", raising=False)
    try:
        startup.lazy_packages()
        assert "sf_not_installed_probe" not in sys.modules  # a missing package stays missing
        import sf_lazy_probe  # type: ignore[import-not-found]

        assert not marker.exists()  # imported, nothing of it ran
        assert sf_lazy_probe.VALUE == 7
        assert marker.read_text() == "x"  # ran once, at the first attribute read
        real = sys.modules["sf_lazy_probe"]  # the real package, where the import put it
        assert type(real) is types.ModuleType and real.VALUE == 7
        startup.lazy_packages()  # imported already: left as it is
        assert sys.modules["sf_lazy_probe"] is real and marker.read_text() == "x"
    finally:
        sys.modules.pop("sf_lazy_probe", None)
