"""Rewrite config keys declared as `key: T = Field(default, description="...", ...)` in the
config blocks (`ConfigView` subclasses) into the project's style: the description as the
docstring under the key, `Field(...)` kept only for a constraint or a factory.

    python cicd/field_docstrings.py src/shardforge/config/schema_*.py
    ruff format src/shardforge/config

For a branch that added keys in the old style: the descriptions stay the same to the letter
(checked here; `shardforge config-schema` prints the same). A key whose declaration holds a
comment, or whose description is not one literal, is left as it is.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

MUTABLE = (ast.List, ast.Dict, ast.Set)


def docstring(text: str, indent: int) -> list[str]:
    """`text` as a docstring wrapped at 100 columns (folded back to one line on load)."""
    if '"""' in text or "\\" in text or text.endswith('"'):
        raise ValueError(f"cannot be a plain docstring: {text!r}")
    pad = " " * indent
    wrapped = textwrap.fill(
        text + '"""', 100, initial_indent=pad + '"""', subsequent_indent=pad,
        break_on_hyphens=False, break_long_words=False,
    )  # fmt: skip
    assert " ".join(wrapped.replace('"""', "").split()) == text, text
    return wrapped.split("\n")


def rewritten(st: ast.AnnAssign, src: str, lines: list[str]) -> list[str] | None:
    """The new lines of one key's declaration (None: left as it is)."""
    call = st.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
        return None
    described = [k for k in call.keywords if k.arg == "description"]
    if call.func.id != "Field" or not described or not isinstance(described[0].value, ast.Constant):
        return None
    if any("#" in line.split('"')[0] for line in lines[st.lineno : st.end_lineno]):
        print(f"left as it is (a comment inside): line {st.lineno}", file=sys.stderr)
        return None
    args = [ast.get_source_segment(src, a) or "" for a in call.args]
    args += [f"{k.arg}={ast.get_source_segment(src, k.value)}" for k in call.keywords if k.arg != "description"]  # fmt: skip
    head = " " * st.col_offset + f"{ast.get_source_segment(src, st.target)}: "
    head += ast.get_source_segment(src, st.annotation) or ""
    if not args:
        new = head
    elif len(args) == 1 and call.args and not isinstance(call.args[0], MUTABLE):
        new = f"{head} = {args[0]}"
    else:
        new = f"{head} = Field({', '.join(args)})"
    return [new, *docstring(described[0].value.value, st.col_offset)]


def convert(path: Path) -> int:
    """Rewrite the keys of `path`'s `ConfigView` blocks in place; how many."""
    src = path.read_text()
    lines = src.split("\n")
    edits = []
    for cls in ast.parse(src).body:
        if isinstance(cls, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id == "ConfigView" for b in cls.bases
        ):
            for st in cls.body:
                new = rewritten(st, src, lines) if isinstance(st, ast.AnnAssign) else None
                if new is not None:
                    edits.append((st.lineno, st.end_lineno or st.lineno, new))
    for first, last, new in reversed(edits):
        lines[first - 1 : last] = new
    path.write_text("\n".join(lines))
    return len(edits)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"{name}: {convert(Path(name))} keys rewritten")
