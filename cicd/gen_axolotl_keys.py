"""Regenerate src/shardforge/config/axolotl_keys.py from a released Axolotl wheel.

    pip download axolotl==0.21.0 --no-deps -d /tmp/axo
    python cicd/gen_axolotl_keys.py /tmp/axo/axolotl-0.21.0-py3-none-any.whl

The wheel is read as a zip and its schema modules as source (`ast`): nothing of Axolotl is
imported or installed. Collected, as Axolotl validates a config:

- the top level: every field of `AxolotlInputConfig` (axolotl/utils/schemas/config.py) and of
  the models it inherits from, a remapped field under its YAML alias and its field name, plus
  the fields of every bundled plugin's input model (the class each `get_input_args` names);
- a `datasets:` entry: the fields of `SFTDataset`, and those `DPODataset`, `KTODataset` and
  `StepwiseSupervisedDataset` add (Axolotl reads the entries of an `rl:` run with them);
- `fsdp_config:`: the fields of `FSDPConfig` (a validation alias such as `version` too);
- the chat template names: the values of the `ChatTemplate` enum.

Each key gets its literal default (an enum member's value; `[]` / `{}` for a list or dict
factory; None when the default is not a literal) and its annotation as written. What shardforge
does with each key is decided in src/shardforge/config/axolotl_status.py, by hand; its tests
fail when a regenerated table has a key without a decision.

Not run by the tests (they have no network and no wheel); run it when Axolotl releases.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "src" / "shardforge" / "config" / "axolotl_keys.py"

SCHEMAS = "axolotl/utils/schemas/"
INTEGRATIONS = "axolotl/integrations/"
TOP_MODEL = ("axolotl.utils.schemas.config", "AxolotlInputConfig")
# an SFT entry first; the preference (DPO, KTO) and stepwise entries add their own fields
DATASET_MODELS = tuple(
    ("axolotl.utils.schemas.datasets", name)
    for name in ("SFTDataset", "DPODataset", "KTODataset", "StepwiseSupervisedDataset")
)
FSDP_MODEL = ("axolotl.utils.schemas.fsdp", "FSDPConfig")
ENUM_MODEL = ("axolotl.utils.schemas.enums", "ChatTemplate")
# bases that end the walk up a model's ancestry (pydantic's and Python's own)
ROOT_BASES = frozenset({"BaseModel", "object", "Generic", "str", "Enum"})


@dataclass(frozen=True)
class Module:
    name: str
    tree: ast.Module
    # local name -> (module, name) of `from X import Y as local`
    imports: dict[str, tuple[str, str]]
    classes: dict[str, ast.ClassDef]


@dataclass(frozen=True)
class FieldInfo:
    default: Any
    annotation: str


def _module_name(path: str) -> str:
    parts = list(PurePosixPath(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def read_modules(wheel: zipfile.ZipFile) -> dict[str, Module]:
    """Every module under the schema and plugin folders, parsed."""
    out: dict[str, Module] = {}
    for path in wheel.namelist():
        if not path.endswith(".py") or not path.startswith((SCHEMAS, INTEGRATIONS)):
            continue
        name = _module_name(path)
        tree = ast.parse(wheel.read(path).decode("utf-8"), filename=path)
        imports: dict[str, tuple[str, str]] = {}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    source = _resolve_relative(
                        name, path.endswith("__init__.py"), node.level, node.module
                    )
                for alias in node.names:
                    imports[alias.asname or alias.name] = (source, alias.name)
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        out[name] = Module(name, tree, imports, classes)
    return out


def find_class(modules: dict[str, Module], module: str, name: str) -> tuple[Module, ast.ClassDef]:
    """The class `name` as seen from `module` (defined there or imported into it)."""
    seen = set()
    while (module, name) not in seen:
        seen.add((module, name))
        mod = modules.get(module)
        if mod is None:
            break
        if name in mod.classes:
            return mod, mod.classes[name]
        if name not in mod.imports:
            break
        module, name = mod.imports[name]
    raise LookupError(f"class {name} not found from {module}")


def _base_names(cls: ast.ClassDef) -> list[str]:
    names = []
    for base in cls.bases:
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def ancestry(modules: dict[str, Module], module: str, name: str) -> list[ast.ClassDef]:
    """`name` and every model it inherits from (depth first, each once)."""
    out: list[ast.ClassDef] = []
    seen: set[int] = set()

    def walk(mod_name: str, cls_name: str) -> None:
        mod, cls = find_class(modules, mod_name, cls_name)
        if id(cls) in seen:
            return
        seen.add(id(cls))
        out.append(cls)
        for base in _base_names(cls):
            if base in ROOT_BASES:
                continue
            try:
                walk(mod.name, base)
            except LookupError:
                print(f"note: base {base} of {cls_name} not found; skipped", file=sys.stderr)

    walk(module, name)
    return out


def _enum_values(modules: dict[str, Module]) -> dict[tuple[str, str], Any]:
    """(EnumClass, member) -> value, for every enum of the parsed modules."""
    out: dict[tuple[str, str], Any] = {}
    for mod in modules.values():
        for cls in mod.classes.values():
            for stmt in cls.body:
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                    target = stmt.targets[0]
                    if isinstance(target, ast.Name):
                        with contextlib.suppress(ValueError):
                            out[(cls.name, target.id)] = ast.literal_eval(stmt.value)
    return out


def _literal(node: ast.expr | None, enums: dict[tuple[str, str], Any]) -> Any:
    if node is None:
        return None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return enums.get((node.value.id, node.attr))
    if isinstance(node, ast.Name) and node.id in ("list", "dict"):
        return [] if node.id == "list" else {}
    if isinstance(node, ast.Lambda):
        return _literal(node.body, enums)
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _field_call(value: ast.expr | None) -> ast.Call | None:
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "Field"
    ):
        return value
    return None


def _aliases(call: ast.Call) -> list[str]:
    """The YAML names a field is also read under: `alias=`, `validation_alias=` strings and
    AliasChoices(...) members."""
    out = []
    for kw in call.keywords:
        if kw.arg not in ("alias", "validation_alias"):
            continue
        if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
            out.append(kw.value.value)
        elif isinstance(kw.value, ast.Call):
            out += [
                a.value
                for a in kw.value.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
    return out


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """A class body's statements, those inside `if`/`try` blocks included."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.If | ast.Try):
            out += _statements(stmt.body) + _statements(getattr(stmt, "orelse", []))
        else:
            out.append(stmt)
    return out


def class_fields(cls: ast.ClassDef, enums: dict[tuple[str, str], Any]) -> dict[str, FieldInfo]:
    out: dict[str, FieldInfo] = {}
    for stmt in _statements(cls.body):
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        name = stmt.target.id
        annotation = ast.unparse(stmt.annotation)
        if name == "model_config" or annotation.startswith("ClassVar"):
            continue
        call = _field_call(stmt.value)
        if call is None:
            info = FieldInfo(_literal(stmt.value, enums), annotation)
            out[name] = info
            continue
        default: Any = None
        for kw in call.keywords:
            if kw.arg in ("default", "default_factory"):
                default = _literal(kw.value, enums)
        if call.args:
            default = _literal(call.args[0], enums)
        info = FieldInfo(default, annotation)
        out[name] = info
        for alias in _aliases(call):
            out[alias] = info
    return out


def model_fields(
    modules: dict[str, Module], model: tuple[str, str], enums: dict[tuple[str, str], Any]
) -> dict[str, FieldInfo]:
    """The fields of a model and its ancestors; a subclass's definition wins."""
    out: dict[str, FieldInfo] = {}
    for cls in reversed(ancestry(modules, *model)):
        out.update(class_fields(cls, enums))
    return out


def plugin_models(modules: dict[str, Module]) -> list[tuple[str, str]]:
    """The (module, class) of every bundled plugin's input arguments (`get_input_args`)."""
    found = []
    pattern = re.compile(r"^(axolotl\.integrations\.[\w.]+)\.(\w+)$")
    for mod in modules.values():
        for node in ast.walk(mod.tree):
            if not isinstance(node, ast.FunctionDef) or node.name != "get_input_args":
                continue
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Constant):
                    m = pattern.match(str(ret.value.value))
                    if m:
                        found.append((m.group(1), m.group(2)))
    return sorted(set(found))


def enum_members(modules: dict[str, Module], model: tuple[str, str]) -> list[Any]:
    _, cls = find_class(modules, *model)
    return [
        ast.literal_eval(s.value)
        for s in cls.body
        if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)
    ]


def collect(wheel_path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(wheel_path) as wheel:
        modules = read_modules(wheel)
        version = _wheel_version(wheel)
    enums = _enum_values(modules)
    top = model_fields(modules, TOP_MODEL, enums)
    for plugin in plugin_models(modules):
        for key, info in model_fields(modules, plugin, enums).items():
            top.setdefault(key, info)
    return {
        "version": version,
        "sha256": hashlib.sha256(wheel_path.read_bytes()).hexdigest(),
        "top": top,
        "datasets": _union(modules, DATASET_MODELS, enums),
        "fsdp": model_fields(modules, FSDP_MODEL, enums),
        "templates": enum_members(modules, ENUM_MODEL),
    }


def _union(
    modules: dict[str, Module],
    models: tuple[tuple[str, str], ...],
    enums: dict[tuple[str, str], Any],
) -> dict[str, FieldInfo]:
    out: dict[str, FieldInfo] = {}
    for model in models:
        for key, info in model_fields(modules, model, enums).items():
            out.setdefault(key, info)
    return out


def _wheel_version(wheel: zipfile.ZipFile) -> str:
    for name in wheel.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in wheel.read(name).decode("utf-8").splitlines():
                if line.startswith("Version: "):
                    return line.split(": ", 1)[1].strip()
    raise SystemExit("no METADATA with a Version in the wheel")


def _table(name: str, comment: str, fields: dict[str, FieldInfo]) -> list[str]:
    lines = [f"# {comment}", f"{name}: dict[str, AxolotlField] = {{"]
    for key in sorted(fields):
        info = fields[key]
        lines.append(f"    {key!r}: AxolotlField({info.default!r}, {info.annotation!r}),")
    return [*lines, "}", ""]


def render(data: dict[str, Any]) -> str:
    templates = ", ".join(repr(t) for t in data["templates"])
    lines = [
        f'"""Axolotl {data["version"]}\'s config keys, their defaults and its chat template '
        "names. GENERATED by",
        "cicd/gen_axolotl_keys.py from the released wheel; do not edit, regenerate:",
        "",
        f"    python cicd/gen_axolotl_keys.py axolotl-{data['version']}-py3-none-any.whl",
        "",
        "What shardforge does with each key is decided in `axolotl_status.py`.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import Any, NamedTuple",
        "",
        f"AXOLOTL_VERSION = {data['version']!r}",
        "# sha256 of the wheel the tables were read from",
        f"AXOLOTL_WHEEL_SHA256 = {data['sha256']!r}",
        "",
        "",
        "class AxolotlField(NamedTuple):",
        '    """One key of Axolotl\'s schema."""',
        "",
        "    # the literal default (None when Axolotl computes it or the key is required)",
        "    default: Any",
        "    # the annotation as Axolotl writes it",
        "    annotation: str",
        "",
        "",
        *_table(
            "TOP_LEVEL_FIELDS",
            "AxolotlInputConfig, the models it inherits from and the bundled plugins' inputs",
            data["top"],
        ),
        *_table(
            "DATASET_FIELDS",
            "one `datasets:` entry: SFTDataset, plus the preference and stepwise entries' fields",
            data["datasets"],
        ),
        *_table("FSDP_CONFIG_FIELDS", "FSDPConfig: the `fsdp_config:` block", data["fsdp"]),
        "# the ChatTemplate enum: every name `chat_template` accepts",
        f"CHAT_TEMPLATE_NAMES: tuple[str, ...] = ({templates},)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="axolotl-<version>-py3-none-any.whl")
    parser.add_argument("--output", type=Path, default=TARGET, help=f"default {TARGET}")
    args = parser.parse_args(argv)
    data = collect(args.wheel)
    args.output.write_text(render(data), encoding="utf-8")
    ruff = shutil.which("ruff")
    if ruff is None:
        print("note: ruff not found; run `ruff format` on the output", file=sys.stderr)
    else:
        subprocess.run([ruff, "format", "--quiet", str(args.output)], check=True)
    print(
        f"{args.output}: Axolotl {data['version']}: {len(data['top'])} top-level keys, "
        f"{len(data['datasets'])} dataset keys, {len(data['fsdp'])} fsdp_config keys, "
        f"{len(data['templates'])} chat templates"
    )


if __name__ == "__main__":
    main()
