"""Chat templates by name, as Axolotl configs spell them (`chat_template: chatml`).

A value containing `{%` or `{{` is Jinja text; any other value must be one of the names below.
`tokenizer_default` keeps the tokenizer's own template; `jinja` takes `chat_template_jinja`.

Every named template renders prefix-consistently (the rendering of the first k messages is a
prefix of the rendering of all of them, and `add_generation_prompt` appends exactly the header
the next assistant turn starts with), which is what lets training find the assistant turns.
"""

from __future__ import annotations

from shardforge.errors import ConfigError

# <|im_start|>role\ncontent<|im_end|>\n (OpenAI ChatML; Qwen, Hermes, many fine-tunes)
_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama 3 / 3.1 instruct: a header per turn, content trimmed, each turn ended by <|eot_id|>
_LLAMA3 = (
    "{% for message in messages %}"
    "{% if loop.first %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# templates without a system role: a system message goes in front of the first user turn
# (`system`), the rest are the `turns`
_SYSTEM_IN_FIRST_TURN = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
)

# Mistral instruct: [INST] user [/INST]answer</s>; a system message is put in front of the
# first user message; user and assistant must alternate
_MISTRAL = (
    _SYSTEM_IN_FIRST_TURN + "{{ bos_token }}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('mistral: roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Gemma (1, 2, 3): <start_of_turn>user|model ... <end_of_turn>; no system role, so a system
# message is put in front of the first user turn (as Gemma 3 does)
_GEMMA = (
    _SYSTEM_IN_FIRST_TURN + "{{ bos_token }}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (system if loop.first else '') }}"
    "{{ (message['content'] | trim) + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# Qwen 2.5: ChatML with Qwen's default system message when the conversation brings none
_QWEN_25 = (
    "{% if not messages or messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Phi-3: <|role|>\ncontent<|end|>\n
_PHI_3 = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Alpaca as a chat: system text, then ### Instruction: / ### Response: blocks
_ALPACA = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
    "{% else %}{{ '### Response:\\n' + message['content'] + eos_token + '\\n\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
)

# name -> Jinja text (names are what the config accepts)
CHAT_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "llama3": _LLAMA3,
    "mistral": _MISTRAL,
    "gemma": _GEMMA,
    "qwen_25": _QWEN_25,
    "phi_3": _PHI_3,
    "alpaca": _ALPACA,
}

# names that do not map to a fixed text
SPECIAL_NAMES: tuple[str, ...] = ("tokenizer_default", "jinja")

CHAT_TEMPLATE_NAMES: tuple[str, ...] = (
    "tokenizer_default",
    "jinja",
    "chatml",
    "llama3",
    "mistral",
    "gemma",
    "qwen_25",
    "phi_3",
    "alpaca",
)


def is_jinja(value: str) -> bool:
    """Only text with a Jinja tag or expression is a template; anything else is a name."""
    return "{%" in value or "{{" in value


def resolve_chat_template(
    cfg_value: str | None, jinja_text: str | None, tokenizer_template: str | None
) -> str | None:
    """The Jinja text the config's `chat_template` stands for.

    null: the tokenizer's own (None when it has none); `tokenizer_default`: the tokenizer's own,
    which must exist; `jinja`: `chat_template_jinja`; a name: its template; Jinja text: itself.
    """
    if cfg_value is None:
        return tokenizer_template
    if cfg_value == "tokenizer_default":
        if not tokenizer_template:
            raise ConfigError(
                "chat_template",
                ["tokenizer_default: the tokenizer has no chat template; name one (e.g. chatml)"],
            )
        return tokenizer_template
    if cfg_value == "jinja":
        if not jinja_text:
            raise ConfigError("chat_template_jinja", ["chat_template: jinja needs the template"])
        return jinja_text
    if cfg_value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[cfg_value]
    if is_jinja(cfg_value):
        return cfg_value
    raise ConfigError(
        "chat_template",
        [f"unknown template name {cfg_value!r}: use one of {', '.join(CHAT_TEMPLATE_NAMES)}"],
    )
