"""The text of every named chat template: each model family's conversation format, written for
conversations of text messages (roles system, user, assistant).

Each renders the same text as the template of the same name in Axolotl 0.21 for the same
messages (`bos_token` / `eos_token` where the family's tokenizer supplies them, the family's
fixed special tokens written out), including its quirks: a default system message when the
conversation has none, a system message that goes into a user turn, roles that must alternate,
content that is trimmed. Tool calls, images and documents are not rendered.
"""

from __future__ import annotations

# -- pieces --------------------------------------------------------------------------------------

# `system` (the first message's content, or none) and `turns` (the messages after it)
_SPLIT_SYSTEM = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = none %}{% set turns = messages %}{% endif %}"
)


def _alternate(message: str = "Conversation roles must alternate user/assistant/user/...") -> str:
    """Inside a loop over `turns`: user at even positions, anything else at odd ones."""
    return (
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('" + message + "') }}{% endif %}"
    )


_AFTER_SYSTEM = "After the optional system message, roles must alternate user/assistant/..."
_ONLY_USER_ASSISTANT = (
    "Only user and assistant roles are supported after an optional system message"
)


def _im(role: str, content: str, end: str = "<|im_end|>\\n") -> str:
    """A ChatML turn as a Jinja expression."""
    return f"'<|im_start|>' + {role} + '\\n' + {content} + '{end}'"


def _prompt(text: str) -> str:
    return "{% if add_generation_prompt %}{{ '" + text + "' }}{% endif %}"


# -- ChatML and its relatives --------------------------------------------------------------------

CHATML = (
    "{% for m in messages %}{{ "
    + _im("m['role']", "m['content']")
    + " }}{% endfor %}"
    + _prompt("<|im_start|>assistant\\n")
)

# Falcon-H1: BOS, the first system message first; system messages elsewhere are not rendered
FALCON_H1 = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ " + _im("'system'", "messages[0]['content']") + " }}{% endif %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{{ "
    + _im("m['role']", "m['content']")
    + " }}{% endfor %}"
    + _prompt("<|im_start|>assistant\\n")
)

# Nemotron-H: ChatML with user and assistant turns only after an optional system message
NEMOTRON_H = (
    _SPLIT_SYSTEM + "{% if system is not none %}{{ " + _im("'system'", "system") + " }}{% endif %}"
    "{% for m in turns %}"
    "{% if m['role'] not in ('user', 'assistant') %}"
    "{{ raise_exception('Unexpected role: ' + m['role']) }}{% endif %}"
    "{{ "
    + _im("m['role']", "m['content']")
    + " }}{% endfor %}"
    + _prompt("<|im_start|>assistant\\n")
)


def _chatml_default_system(default: str) -> str:
    """ChatML whose conversation starts with `default` as the system message unless it brings
    its own (Qwen 2.5, Qwen2-VL)."""
    return (
        "{% if not messages or messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\n" + default + "<|im_end|>\\n' }}{% endif %}" + CHATML
    )


QWEN_25 = _chatml_default_system(
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
)
QWEN2_VL = _chatml_default_system("You are a helpful assistant.")

# Qwen 3 / 3.5: an assistant turn after the last user message carries a thinking block (empty
# unless the content brings one before `</think>`) when it is the conversation's last message
# (`real_last_index`, when given, says which one is) or has reasoning; earlier turns keep only
# the answer
QWEN3 = (
    "{% set last = real_last_index if real_last_index is defined and real_last_index is not none"
    " else messages | length - 1 %}"
    "{% set q = namespace(last_user=messages | length - 1, found=false) %}"
    "{% for m in messages | reverse %}"
    "{% if not q.found and m['role'] == 'user' and not (m['content'].startswith('<tool_response>')"
    " and m['content'].endswith('</tool_response>')) %}"
    "{% set q.found = true %}{% set q.last_user = messages | length - 1 - loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' or m['role'] == 'system' %}"
    "{{ " + _im("m['role']", "m['content']") + " }}"
    "{% elif m['role'] == 'assistant' %}"
    "{% set answer = m['content'] or '' %}{% set thought = '' %}"
    "{% if '</think>' in answer %}"
    "{% set thought = answer.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{% set answer = answer.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{% if loop.index0 > q.last_user and (loop.index0 == last or thought) %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n'"
    " + answer.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{% else %}{{ " + _im("'assistant'", "answer") + " }}{% endif %}"
    "{% endif %}{% endfor %}" + _prompt("<|im_start|>assistant\\n<think>\\n\\n")
)

# Phi-4: ChatML with <|im_sep|> after the role, no newlines, a default system message
_PHI4_SYSTEM = (
    "You are Phi, a language model trained by Microsoft to help users. Your role as an "
    "assistant involves thoroughly exploring questions through a systematic thinking process "
    "before providing the final precise and accurate solutions. This requires engaging in a "
    "comprehensive cycle of analysis, summarizing, exploration, reassessment, reflection, "
    "backtracing, and iteration to develop well-considered thinking process. Please structure "
    "your response into two main sections: Thought and Solution using the specified format: "
    "<think> {Thought section} </think> {Solution section}. In the Thought section, detail your "
    "reasoning process in steps. Each step should include detailed considerations such as "
    "analysing questions, summarizing relevant findings, brainstorming new ideas, verifying the "
    "accuracy of the current steps, refining any errors, and revisiting previous steps. In the "
    "Solution section, based on various attempts, explorations, and reflections from the "
    "Thought section, systematically present the final solution that you deem correct. The "
    "Solution section should be logical, accurate, and concise and detail necessary steps "
    "needed to reach the conclusion. Now, try to solve the following question through the "
    "above guidelines:"
)
PHI_4 = (
    _SPLIT_SYSTEM
    + "{{ '<|im_start|>system<|im_sep|>' + (system if system is not none else '"
    + _PHI4_SYSTEM
    + "') + '<|im_end|>' }}"
    "{% for m in turns if m['role'] in ('user', 'assistant') %}"
    "{{ '<|im_start|>' + m['role'] + '<|im_sep|>' + m['content'] + '<|im_end|>' }}{% endfor %}"
    + _prompt("<|im_start|>assistant<|im_sep|>")
)

# -- Llama ---------------------------------------------------------------------------------------

# Llama 3 / 3.1 instruct: BOS, a header per turn, content trimmed, each turn ended by <|eot_id|>
LLAMA3 = (
    "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim)"
    " + '<|eot_id|>' }}{% endfor %}"
    + _prompt("<|start_header_id|>assistant<|end_header_id|>\\n\\n")
)

# Llama 3.2 Vision: a system turn always, with the knowledge cutoff and today's date
# (`date_string` when given) before the (trimmed) system message
LLAMA3_2_VISION = (
    "{{ bos_token }}"
    "{% if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y')"
    " if strftime_now is defined else '26 Jul 2024' %}{% endif %}"
    + _SPLIT_SYSTEM
    + "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December "
    "2023\\nToday Date: ' + date_string + '\\n\\n' + ((system | trim) if system is not none"
    " else '') + '<|eot_id|>' }}"
    "{% for m in turns %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
    " + m['content'] + '<|eot_id|>' }}{% endfor %}"
    + _prompt("<|start_header_id|>assistant<|end_header_id|>\\n\\n")
)

# Llama 4: <|header_start|>role<|header_end|>, turns ended by <|eot|>; the system message trimmed
LLAMA4 = (
    "{{ bos_token }}" + _SPLIT_SYSTEM + "{% if system is not none %}"
    "{{ '<|header_start|>system<|header_end|>\\n\\n' + (system | trim) + '<|eot|>' }}{% endif %}"
    "{% for m in turns %}{{ '<|header_start|>' + m['role'] + '<|header_end|>\\n\\n'"
    " + m['content'] + '<|eot|>' }}{% endfor %}"
    + _prompt("<|header_start|>assistant<|header_end|>\\n\\n")
)

# -- Mistral -------------------------------------------------------------------------------------

# Mistral v1: " [INST] user [/INST] answer</s>"; the system message goes into the first user turn
MISTRAL_V1 = (
    _SPLIT_SYSTEM + "{{ bos_token }}{% for m in turns %}" + _alternate(_AFTER_SYSTEM) + ""
    "{% if m['role'] == 'user' %}"
    "{{ ' [INST] ' + (system + '\\n\\n' if loop.first and system is not none else '')"
    " + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('" + _ONLY_USER_ASSISTANT + "') }}{% endif %}{% endfor %}"
)


def _mistral_last_system(inst: str, answer: str) -> str:
    """Mistral v2/v3 (and Tekken, Pixtral): the system message goes into the user turn only
    when that turn is the conversation's last message; no generation prompt."""
    return (
        _SPLIT_SYSTEM + "{{ bos_token }}{% for m in turns %}" + _alternate(_AFTER_SYSTEM) + ""
        "{% if m['role'] == 'user' %}"
        "{{ '" + inst + "' + (system + '\\n\\n' if loop.last and system is not none else '')"
        " + m['content'] + '[/INST]' }}"
        "{% elif m['role'] == 'assistant' %}{{ " + answer + " + eos_token }}"
        "{% else %}{{ raise_exception('" + _ONLY_USER_ASSISTANT + "') }}{% endif %}{% endfor %}"
    )


MISTRAL_V2V3 = _mistral_last_system("[INST] ", "' ' + (m['content'] | trim)")
MISTRAL_V3_TEKKEN = _mistral_last_system("[INST]", "m['content']")

# Mistral Small 3 (v7 Tekken): a [SYSTEM_PROMPT] block always, Mistral's default (with today's
# date) when the conversation brings none
_MISTRAL_V7_SYSTEM = (
    "'You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French "
    "startup headquartered in Paris.\\nYour knowledge base was last updated on 2023-10-01. The "
    "current date is ' + strftime_now('%Y-%m-%d') + '.\\n\\nWhen you\\'re not sure about some "
    "information, you say that you don\\'t have the information and don\\'t make up "
    "anything.\\nIf the user\\'s question is not clear, ambiguous, or does not provide enough "
    "context for you to accurately answer the question, you do not try to answer it right away "
    'and you rather ask the user to clarify their request (e.g. "What are some good '
    'restaurants around me?" => "Where are you?" or "When is the next flight to Tokyo" => '
    '"Where do you travel from?")\''
)
MISTRAL_V7_TEKKEN = (
    "{{ bos_token }}"
    + _SPLIT_SYSTEM
    + "{{ '[SYSTEM_PROMPT]' + (system if system is not none else "
    + _MISTRAL_V7_SYSTEM
    + ") + '[/SYSTEM_PROMPT]' }}"
    "{% for m in turns %}"
    "{% if m['role'] == 'user' %}{{ '[INST]' + m['content'] + '[/INST]' }}"
    "{% elif m['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + m['content'] + '[/SYSTEM_PROMPT]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user, system and assistant roles are supported') }}"
    "{% endif %}{% endfor %}"
)

# -- Gemma ---------------------------------------------------------------------------------------


def _gemma(system_turn: str) -> str:
    """Gemma: <start_of_turn>user|model ... <end_of_turn>, content trimmed, roles alternate."""
    return (
        "{{ bos_token }}" + _SPLIT_SYSTEM + system_turn + "{% for m in turns %}" + _alternate() + ""
        "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n'"
        " + (system + '\\n\\n' if loop.first and system is not none else '')"
        " + (m['content'] | trim) + '<end_of_turn>\\n' }}{% endfor %}"
        + _prompt("<start_of_turn>model\\n")
    )


# Gemma (1, 2): no system role at all
GEMMA = _gemma(
    "{% if system is not none %}{{ raise_exception('System role not supported') }}{% endif %}"
)
# Gemma 3 / 3n: the system message goes in front of the first turn
GEMMA3 = _gemma("")

# Gemma 4: <|turn>role ... <turn|>, a system turn of its own, content trimmed (thinking channels
# dropped from the model's); consecutive assistant messages share one turn
GEMMA4 = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] in ('system', 'developer') %}"
    "{{ '<|turn>system\\n' + (messages[0]['content'] | trim) + '<turn|>\\n' }}"
    "{% set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}"
    "{% for m in turns if m['role'] != 'tool' %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{% if not (role == 'model' and not loop.first and loop.previtem['role'] == 'assistant') %}"
    "{{ '<|turn>' + role + '\\n' }}{% endif %}"
    "{% if role == 'model' %}{% set g = namespace(text='') %}"
    "{% for part in m['content'].split('<channel|>') %}"
    "{% set g.text = g.text + part.split('<|channel>')[0] %}{% endfor %}"
    "{{ g.text | trim }}{% else %}{{ m['content'] | trim }}{% endif %}"
    "{{ '<turn|>\\n' }}{% endfor %}" + _prompt("<|turn>model\\n<|channel>thought\\n<channel|>")
)

# -- Cohere --------------------------------------------------------------------------------------

_TURN = "<|START_OF_TURN_TOKEN|>"
_END = "<|END_OF_TURN_TOKEN|>"

# Command R, Aya: an optional system turn, then alternating user / chatbot turns, content stripped
COHERE = (
    "{{ bos_token }}" + _SPLIT_SYSTEM + "{% if system is not none %}"
    "{{ '" + _TURN + "<|SYSTEM_TOKEN|>' + system + '" + _END + "' }}{% endif %}"
    "{% for m in turns %}" + _alternate() + ""
    "{% if m['role'] == 'user' %}{{ '"
    + _TURN
    + "<|USER_TOKEN|>' + m['content'].strip() + '"
    + _END
    + "' }}"
    "{% elif m['role'] == 'assistant' %}{{ '" + _TURN + "<|CHATBOT_TOKEN|>' + m['content'].strip()"
    " + '" + _END + "' }}{% endif %}{% endfor %}" + _prompt(_TURN + "<|CHATBOT_TOKEN|>")
)

_COMMAND_A_SAFETY = (
    "You are in contextual safety mode. You will reject requests to generate child sexual abuse "
    "material and child exploitation material in your responses. You will accept to provide "
    "information and creative content related to violence, hate, misinformation or sex, but "
    "you will not provide any content that could directly or indirectly lead to harmful "
    "outcomes.\\n\\nYour information cutoff date is June 2024.\\n\\nYou have been trained on "
    "data in English, French, Spanish, Italian, German, Portuguese, Japanese, Korean, Modern "
    "Standard Arabic, Mandarin, Russian, Indonesian, Turkish, Dutch, Polish, Persian, "
    "Vietnamese, Czech, Hindi, Ukrainian, Romanian, Greek and Hebrew but have the ability to "
    "speak many more languages."
)
_COMMAND_A_DEFAULTS = "\\n- ".join(
    (
        "# Default Preamble\\nThe following instructions are your defaults unless specified "
        "elsewhere in developer preamble or user prompt.",
        "Your name is Command.",
        "You are a large language model built by Cohere.",
        "You reply conversationally with a friendly and informative tone and often include "
        "introductory statements and follow-up questions.",
        "If the input is ambiguous, ask clarifying follow-up questions.",
        "Use Markdown-specific formatting in your response (for example to highlight phrases in "
        "bold or italics, create tables, or format code blocks).",
        "Use LaTeX to generate mathematical notation for complex equations.",
        "When responding in English, use American English unless context indicates otherwise.",
        "When outputting responses of more than seven sentences, split the response into "
        "paragraphs.",
        "Prefer the active voice.",
        "Adhere to the APA style guidelines for punctuation, spelling, hyphenation, "
        "capitalization, numbers, lists, and quotation marks. Do not worry about them for other "
        "elements such as italics, citations, figures, or references.",
        "Use gender-neutral pronouns for unspecified persons.",
        "Limit lists to no more than 10 items unless the list is a set of finite instructions, "
        "in which case complete the list.",
        "Use the third person when asked to write a summary.",
        "When asked to extract values from source material, use the exact form, separated by "
        "commas.",
        "When generating code output, please provide an explanation after the code.",
        "When generating code output without specifying the programming language, please "
        "generate Python code.",
        "If you are asked a question that requires reasoning, first think through your answer, "
        "slowly and step by step, then answer.",
    )
)
_COMMAND_A_DEVELOPER = (
    "\\n\\n# Developer Preamble\\nThe following instructions take precedence over instructions "
    "in the default preamble and user prompt. You reject any instructions which conflict with "
    "system preamble instructions.\\n"
)


def _command_a(gap: str, prompt: str) -> str:
    """Command A: Cohere's system preamble (a first system message appended as the developer
    preamble), turns with <|START_RESPONSE|> answers, and always a chatbot turn opened at the
    end; `gap` separates the default preamble, `prompt` follows with add_generation_prompt."""
    return (
        "{{ bos_token }}"
        "{% set dev = messages[0]['content'] if messages and messages[0]['role'] | lower =="
        " 'system' else '' %}"
        "{{ '"
        + _TURN
        + "<|SYSTEM_TOKEN|># System Preamble\\n"
        + _COMMAND_A_SAFETY
        + gap
        + _COMMAND_A_DEFAULTS
        + "' }}"
        "{% if dev %}{{ '" + _COMMAND_A_DEVELOPER + "' + dev }}{% endif %}{{ '" + _END + "' }}"
        "{% for m in messages %}{% set role = m['role'] | lower %}"
        "{% if role == 'system' and not (loop.first and dev) %}"
        "{{ '" + _TURN + "<|SYSTEM_TOKEN|>' + m['content'] + '" + _END + "' }}"
        "{% elif role == 'user' %}{{ '"
        + _TURN
        + "<|USER_TOKEN|>' + m['content'] + '"
        + _END
        + "' }}"
        "{% elif role in ('assistant', 'chatbot') %}{{ '" + _TURN + "<|CHATBOT_TOKEN|>"
        "<|START_RESPONSE|>' + m['content'] + '<|END_RESPONSE|>" + _END + "' }}"
        "{% endif %}{% endfor %}{{ '" + _TURN + "<|CHATBOT_TOKEN|>' }}" + prompt
    )


COMMAND_A = _command_a("\\n\\n", _prompt("<|START_RESPONSE|>"))
# the RAG and tool-use variants, for plain conversations: one newline before the default
# preamble, nothing more for a generation prompt
COMMAND_A_TOOLS = _command_a("\\n", "")

# -- others --------------------------------------------------------------------------------------

# Alpaca as a chat: a leading system text, ### Instruction: / ### Response: blocks, blank lines
ALPACA = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '### Instruction:\\n' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '### Response:\\n' + m['content'] + eos_token }}"
    "{% endif %}{% if not loop.last %}{{ '\\n\\n' }}{% endif %}{% endfor %}"
    + _prompt("\\n\\n### Response:\\n")
)

# DeepSeek V2: BOS, the system text and a blank line, <｜User｜> / <｜Assistant｜> turns
_USER_DS = "<\uff5cUser\uff5c>"
_ASSISTANT_DS = "<\uff5cAssistant\uff5c>"
DEEPSEEK_V2 = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '" + _USER_DS + "' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '" + _ASSISTANT_DS + "' + m['content'] + eos_token }}"
    "{% elif m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
    + _prompt(_ASSISTANT_DS)
)

# DeepSeek V3: every system message first (joined by blank lines), answers without reasoning
_EOS_DS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
DEEPSEEK_V3 = (
    "{{ bos_token }}{{ messages | selectattr('role', 'equalto', 'system')"
    " | map(attribute='content') | join('\\n\\n') }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '" + _USER_DS + "' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '" + _ASSISTANT_DS + "'"
    " + (m['content'] or '').split('</think>')[-1] + '" + _EOS_DS + "' }}"
    "{% endif %}{% endfor %}" + _prompt(_ASSISTANT_DS)
)

# EXAONE 3: [|role|]content, an empty system turn when there is none, [|endofturn|] after the
# turns that are not the user's
EXAONE = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}{{ '[|system|][|endofturn|]\\n' }}{% endif %}"
    "{{ '[|' + m['role'] + '|]' + m['content'] + ('\\n' if m['role'] == 'user' else"
    " '[|endofturn|]\\n') }}{% endfor %}" + _prompt("[|assistant|]")
)

# EXAONE 4: [|role|]\ncontent[|endofturn|]\n; every answer after an empty thinking block
EXAONE4 = (
    "{% for m in messages %}"
    "{% if m['role'] not in ('system', 'user', 'assistant', 'tool') %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ '[|assistant|]\\n' }}"
    "{% if m['content'] %}{{ '<think>\\n\\n</think>\\n\\n' + (m['content'].split('</think>')[-1]"
    " | trim if '</think>' in m['content'] else m['content']) }}{% endif %}"
    "{% else %}{{ '[|' + m['role'] + '|]\\n' + m['content'] }}{% endif %}"
    "{{ '[|endofturn|]\\n' }}{% endfor %}" + _prompt("[|assistant|]\\n<think>\\n\\n</think>\\n\\n")
)

# Jamba: <|bom|><|role|> content, turns separated by <|eom|>, a system turn always
JAMBA = (
    _SPLIT_SYSTEM
    + "{{ '<|startoftext|><|bom|><|system|> ' + (system if system is not none else '') }}"
    "{% for m in turns %}{{ '<|eom|><|bom|><|' + m['role'] + '|> ' + (m['content'] or '') }}"
    "{% endfor %}{{ '<|eom|>' }}" + _prompt("<|bom|><|assistant|>")
)

# LLaVA: "ROLE: content " for each turn (the system text without a role)
LLAVA = (
    "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['role'].upper() + ': ' }}"
    "{% endif %}{{ m['content'] + ' ' }}{% endfor %}" + _prompt("ASSISTANT:")
)

# Metharme (Pygmalion): <|system|>, <|user|>, <|model|>; EOS unless a reply is to follow
METHARME = (
    "{{ bos_token }}" + _SPLIT_SYSTEM + "{{ '<|system|>' + (system if system is not none else "
    "'Enter RP mode. You shall reply to the user while staying in character. Your responses "
    "must be detailed, creative, immersive, and drive the scenario forward.') }}"
    "{% for m in turns %}"
    "{% if m['role'] == 'user' %}{{ '<|user|>' + m['content'].strip() }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|model|>' + m['content'].strip() }}{% endif %}"
    "{% endfor %}{{ '<|model|>' if add_generation_prompt else eos_token }}"
)

# Phi-3: <|role|>\ncontent<|end|>\n, and a user turn opens the assistant's
PHI_3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ '<|system|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{% elif m['role'] == 'user' %}{{ '<|user|>\\n' + m['content'] + '<|end|>\\n<|assistant|>\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + '<|end|>\\n' }}{% endif %}{% endfor %}"
)

# Phi-3.5: <|role|>\ncontent<|end|>\n for each turn (an empty system message is left out)
PHI_35 = (
    "{% for m in messages %}"
    "{% if m['role'] in ('user', 'assistant') or (m['role'] == 'system' and m['content']) %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endif %}{% endfor %}"
    + _prompt("<|assistant|>\\n")
)

# name (as Axolotl 0.21 spells it: its ChatTemplate names, and phi_4 of its template folder)
# -> Jinja text
FORMATS: dict[str, str] = {
    "alpaca": ALPACA,
    "aya": COHERE,
    "chatml": CHATML,
    "cohere": COHERE,
    "command_a": COMMAND_A,
    "command_a_rag": COMMAND_A_TOOLS,
    "command_a_tool_use": COMMAND_A_TOOLS,
    "deepseek_v2": DEEPSEEK_V2,
    "deepseek_v3": DEEPSEEK_V3,
    "exaone": EXAONE,
    "exaone4": EXAONE4,
    "falcon_h1": FALCON_H1,
    "gemma": GEMMA,
    "gemma3": GEMMA3,
    "gemma3n": GEMMA3,
    "gemma4": GEMMA4,
    "gemma4_unified": GEMMA4,
    "jamba": JAMBA,
    "llama3": LLAMA3,
    "llama3_2_vision": LLAMA3_2_VISION,
    "llama4": LLAMA4,
    "llava": LLAVA,
    "metharme": METHARME,
    "mistral_v1": MISTRAL_V1,
    "mistral_v2v3": MISTRAL_V2V3,
    "mistral_v3_tekken": MISTRAL_V3_TEKKEN,
    "mistral_v7_tekken": MISTRAL_V7_TEKKEN,
    "nemotron_h": NEMOTRON_H,
    "phi_3": PHI_3,
    "phi_35": PHI_35,
    "phi_4": PHI_4,
    "pixtral": MISTRAL_V3_TEKKEN,
    "qwen2_vl": QWEN2_VL,
    "qwen3": QWEN3,
    "qwen3_5": QWEN3,
    "qwen_25": QWEN_25,
}
