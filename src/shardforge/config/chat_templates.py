"""Chat templates by name, as Axolotl configs spell them (`chat_template: chatml`).

Every name of Axolotl 0.21's `ChatTemplate` is accepted, each mapped to a template of
`chat_formats` that renders the same text as Axolotl's. Besides a name the value may be:

    null                          the tokenizer's own (`chat_template_jinja` when that is set)
    tokenizer_default             the tokenizer's own, which must exist
    tokenizer_default_fallback_X  the tokenizer's own, else the template named X
    jinja                         `chat_template_jinja`: Jinja text, or a file holding it
    Jinja text                    itself (a value containing `{%` or `{{`)

`train` refuses any other value, listing the names; the other commands read it only where they
write a tokenizer (the merge keeps the tokenizer's own template then, with a notice).
"""

from __future__ import annotations

import difflib
import textwrap
from pathlib import Path

from shardforge.config.chat_formats import FORMATS
from shardforge.errors import ConfigError, shown

# shardforge's Mistral template from before Axolotl's names were all known: "[INST] " without
# the leading space of mistral_v1, the answer right after "[/INST]"
_MISTRAL = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}{{ bos_token }}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('mistral: roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

# name -> Jinja text (names are what the config accepts)
CHAT_TEMPLATES: dict[str, str] = {**FORMATS, "mistral": _MISTRAL}

# names that do not map to a fixed text
SPECIAL_NAMES: tuple[str, ...] = ("tokenizer_default", "jinja")
FALLBACK_PREFIX = "tokenizer_default_fallback_"

# every name `chat_template` accepts: Axolotl's and shardforge's `mistral`
CHAT_TEMPLATE_NAMES: tuple[str, ...] = (*SPECIAL_NAMES, *sorted(CHAT_TEMPLATES))


def is_jinja(value: str) -> bool:
    """Only text with a Jinja tag or expression is a template; anything else is a name."""
    return "{%" in value or "{{" in value


def template_problem(value: str | None, jinja_text: str | None) -> str | None:
    """Why `value` (with `chat_template_jinja`) names no template, or None when it does (or
    when the tokenizer's own is meant: that is checked where the tokenizer is loaded)."""
    if value is None or is_jinja(value) or value in CHAT_TEMPLATES or value == SPECIAL_NAMES[0]:
        return None
    if value == "jinja":
        return (
            None if jinja_text else "chat_template: jinja needs the template in chat_template_jinja"
        )
    named = value.removeprefix(FALLBACK_PREFIX)
    if named != value and named in CHAT_TEMPLATES:
        return None
    close = difflib.get_close_matches(value, CHAT_TEMPLATE_NAMES, n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    names = textwrap.fill(
        ", ".join(CHAT_TEMPLATE_NAMES) + f", {FALLBACK_PREFIX}<name>, or Jinja text (with {{% or "
        "{{)",
        width=_WIDTH,
        initial_indent="    ",
        subsequent_indent="    ",
    )
    return f"chat_template: unknown template name {shown(value, 80)}{hint}; use one of\n{names}"


# the list of names goes on lines of at most this many characters (an error's detail lines)
_WIDTH = 100


def _jinja_text(jinja_text: str) -> str:
    """`chat_template_jinja`: the text itself, or the file it names (as Axolotl reads it)."""
    if is_jinja(jinja_text) or "\n" in jinja_text:
        return jinja_text
    path = Path(jinja_text).expanduser()
    if not path.is_file():
        return jinja_text
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("chat_template_jinja", [f"{path}: cannot read it ({exc})"]) from None


def resolve_chat_template(
    cfg_value: str | None, jinja_text: str | None, tokenizer_template: str | None
) -> str | None:
    """The Jinja text the config's `chat_template` stands for (see the module's table); None
    when it means the tokenizer's own and the tokenizer has none."""
    if cfg_value is None:
        return _jinja_text(jinja_text) if jinja_text else tokenizer_template
    problem = template_problem(cfg_value, jinja_text)
    if problem is not None:
        raise ConfigError("chat_template", [problem.removeprefix("chat_template: ")])
    if cfg_value == "tokenizer_default":
        if not tokenizer_template:
            raise ConfigError(
                "chat_template",
                ["tokenizer_default: the tokenizer has no chat template; name one (e.g. chatml)"],
            )
        return tokenizer_template
    if cfg_value == "jinja":
        assert jinja_text is not None  # template_problem refused it otherwise
        return _jinja_text(jinja_text)
    if cfg_value.startswith(FALLBACK_PREFIX) and cfg_value not in CHAT_TEMPLATES:
        return tokenizer_template or CHAT_TEMPLATES[cfg_value.removeprefix(FALLBACK_PREFIX)]
    return CHAT_TEMPLATES.get(cfg_value, cfg_value)
