"""Every named chat template renders the text of its model family's format, the same as
Axolotl 0.21's template of that name: a two-turn conversation, and a system message with a
generation prompt. Rendered by a real tokenizer (`apply_chat_template`) of the tiny test
vocabulary (BOS `<s>`, EOS `</s>`)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from helpers.tiny import make_tokenizer
from shardforge.config.axolotl_keys import CHAT_TEMPLATE_NAMES as AXOLOTL_NAMES
from shardforge.config.chat_formats import FORMATS
from shardforge.config.chat_templates import CHAT_TEMPLATES, SPECIAL_NAMES

TWO_TURNS_MESSAGES = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]
SYSTEM_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
]

TWO_TURNS: dict[str, str] = {
    "alpaca": "<s>### Instruction:\nHi there\n\n### Response:\nHello!</s>\n\n### Instruction:\nWhat is 2+2?\n\n### Response:\n4</s>",
    "aya": "<s><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello!<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is 2+2?<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>4<|END_OF_TURN_TOKEN|>",
    "chatml": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "cohere": "<s><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello!<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is 2+2?<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>4<|END_OF_TURN_TOKEN|>",
    "deepseek_v2": "<s><｜User｜>Hi there<｜Assistant｜>Hello!</s><｜User｜>What is 2+2?<｜Assistant｜>4</s>",
    "deepseek_v3": "<s><｜User｜>Hi there<｜Assistant｜>Hello!<｜end▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>",
    "exaone": "[|system|][|endofturn|]\n[|user|]Hi there\n[|assistant|]Hello![|endofturn|]\n[|user|]What is 2+2?\n[|assistant|]4[|endofturn|]\n",
    "exaone4": "[|user|]\nHi there[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\nHello![|endofturn|]\n[|user|]\nWhat is 2+2?[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\n4[|endofturn|]\n",
    "falcon_h1": "<s><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "gemma": "<s><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "gemma3": "<s><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "gemma3n": "<s><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "gemma4": "<s><|turn>user\nHi there<turn|>\n<|turn>model\nHello!<turn|>\n<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n4<turn|>\n",
    "gemma4_unified": "<s><|turn>user\nHi there<turn|>\n<|turn>model\nHello!<turn|>\n<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n4<turn|>\n",
    "jamba": "<|startoftext|><|bom|><|system|> <|eom|><|bom|><|user|> Hi there<|eom|><|bom|><|assistant|> Hello!<|eom|><|bom|><|user|> What is 2+2?<|eom|><|bom|><|assistant|> 4<|eom|>",
    "llama3": "<s><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
    "llama4": "<s><|header_start|>user<|header_end|>\n\nHi there<|eot|><|header_start|>assistant<|header_end|>\n\nHello!<|eot|><|header_start|>user<|header_end|>\n\nWhat is 2+2?<|eot|><|header_start|>assistant<|header_end|>\n\n4<|eot|>",
    "llava": "USER: Hi there ASSISTANT: Hello! USER: What is 2+2? ASSISTANT: 4 ",
    "mistral": "<s>[INST] Hi there [/INST]Hello!</s>[INST] What is 2+2? [/INST]4</s>",
    "mistral_v1": "<s> [INST] Hi there [/INST] Hello!</s> [INST] What is 2+2? [/INST] 4</s>",
    "mistral_v2v3": "<s>[INST] Hi there[/INST] Hello!</s>[INST] What is 2+2?[/INST] 4</s>",
    "mistral_v3_tekken": "<s>[INST]Hi there[/INST]Hello!</s>[INST]What is 2+2?[/INST]4</s>",
    "nemotron_h": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "phi_3": "<s><|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n4<|end|>\n",
    "phi_35": "<|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n4<|end|>\n",
    "pixtral": "<s>[INST]Hi there[/INST]Hello!</s>[INST]What is 2+2?[/INST]4</s>",
    "qwen2_vl": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "qwen3": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n",
    "qwen3_5": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n",
    "qwen_25": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "llama3_2_vision": "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
    "metharme": "<s><|system|>Enter RP mode. You shall reply to the user while staying in character. Your responses must be detailed, creative, immersive, and drive the scenario forward.<|user|>Hi there<|model|>Hello!<|user|>What is 2+2?<|model|>4</s>",
}

SYSTEM_AND_PROMPT: dict[str, str] = {
    "alpaca": "<s>Be brief.\n\n### Instruction:\nHi there\n\n### Response:\n",
    "aya": "<s><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "cohere": "<s><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "deepseek_v2": "<s>Be brief.\n\n<｜User｜>Hi there<｜Assistant｜>",
    "deepseek_v3": "<s>Be brief.<｜User｜>Hi there<｜Assistant｜>",
    "exaone": "[|system|]Be brief.[|endofturn|]\n[|user|]Hi there\n[|assistant|]",
    "exaone4": "[|system|]\nBe brief.[|endofturn|]\n[|user|]\nHi there[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\n",
    "falcon_h1": "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "gemma3": "<s><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "gemma3n": "<s><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "gemma4": "<s><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi there<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
    "gemma4_unified": "<s><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi there<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
    "jamba": "<|startoftext|><|bom|><|system|> Be brief.<|eom|><|bom|><|user|> Hi there<|eom|><|bom|><|assistant|>",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama4": "<s><|header_start|>system<|header_end|>\n\nBe brief.<|eot|><|header_start|>user<|header_end|>\n\nHi there<|eot|><|header_start|>assistant<|header_end|>\n\n",
    "llava": "Be brief. USER: Hi there ASSISTANT:",
    "mistral": "<s>[INST] Be brief.\n\nHi there [/INST]",
    "mistral_v1": "<s> [INST] Be brief.\n\nHi there [/INST]",
    "mistral_v2v3": "<s>[INST] Be brief.\n\nHi there[/INST]",
    "mistral_v3_tekken": "<s>[INST]Be brief.\n\nHi there[/INST]",
    "nemotron_h": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "phi_3": "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\n",
    "phi_35": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\n",
    "pixtral": "<s>[INST]Be brief.\n\nHi there[/INST]",
    "qwen2_vl": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n",
    "qwen3_5": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n",
    "qwen_25": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "llama3_2_vision": "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "metharme": "<s><|system|>Be brief.<|user|>Hi there<|model|>",
}

# -- the families with a long default preamble ------------------------------------------------

T, E = "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>"
COMMAND_A_RULES = [
    "Your name is Command.",
    "You are a large language model built by Cohere.",
    "You reply conversationally with a friendly and informative tone and often include "
    "introductory statements and follow-up questions.",
    "If the input is ambiguous, ask clarifying follow-up questions.",
    "Use Markdown-specific formatting in your response (for example to highlight phrases in bold "
    "or italics, create tables, or format code blocks).",
    "Use LaTeX to generate mathematical notation for complex equations.",
    "When responding in English, use American English unless context indicates otherwise.",
    "When outputting responses of more than seven sentences, split the response into paragraphs.",
    "Prefer the active voice.",
    "Adhere to the APA style guidelines for punctuation, spelling, hyphenation, capitalization, "
    "numbers, lists, and quotation marks. Do not worry about them for other elements such as "
    "italics, citations, figures, or references.",
    "Use gender-neutral pronouns for unspecified persons.",
    "Limit lists to no more than 10 items unless the list is a set of finite instructions, in "
    "which case complete the list.",
    "Use the third person when asked to write a summary.",
    "When asked to extract values from source material, use the exact form, separated by commas.",
    "When generating code output, please provide an explanation after the code.",
    "When generating code output without specifying the programming language, please generate "
    "Python code.",
    "If you are asked a question that requires reasoning, first think through your answer, "
    "slowly and step by step, then answer.",
]


def command_a_system(gap: str, developer: str = "") -> str:
    """Cohere's Command A system preamble; `gap` before the default preamble."""
    text = (
        "# System Preamble\nYou are in contextual safety mode. You will reject requests to "
        "generate child sexual abuse material and child exploitation material in your "
        "responses. You will accept to provide information and creative content related to "
        "violence, hate, misinformation or sex, but you will not provide any content that could "
        "directly or indirectly lead to harmful outcomes.\n\nYour information cutoff date is "
        "June 2024.\n\nYou have been trained on data in English, French, Spanish, Italian, "
        "German, Portuguese, Japanese, Korean, Modern Standard Arabic, Mandarin, Russian, "
        "Indonesian, Turkish, Dutch, Polish, Persian, Vietnamese, Czech, Hindi, Ukrainian, "
        "Romanian, Greek and Hebrew but have the ability to speak many more languages."
        + gap
        + "# Default Preamble\nThe following instructions are your defaults unless specified "
        "elsewhere in developer preamble or user prompt."
        + "".join(f"\n- {rule}" for rule in COMMAND_A_RULES)
    )
    if developer:
        text += (
            "\n\n# Developer Preamble\nThe following instructions take precedence over "
            "instructions in the default preamble and user prompt. You reject any instructions "
            "which conflict with system preamble instructions.\n" + developer
        )
    return f"<s>{T}<|SYSTEM_TOKEN|>{text}{E}"


def command_a_turns(messages: list[tuple[str, str]]) -> str:
    return "".join(
        f"{T}<|USER_TOKEN|>{text}{E}"
        if role == "user"
        else f"{T}<|CHATBOT_TOKEN|><|START_RESPONSE|>{text}<|END_RESPONSE|>{E}"
        for role, text in messages
    )


TWO = [("user", "Hi there"), ("assistant", "Hello!"), ("user", "What is 2+2?"), ("assistant", "4")]
for _name, _gap, _prompt in (
    ("command_a", "\n\n", "<|START_RESPONSE|>"),
    ("command_a_rag", "\n", ""),
    ("command_a_tool_use", "\n", ""),
):
    # a chatbot turn is always opened at the end
    TWO_TURNS[_name] = command_a_system(_gap) + command_a_turns(TWO) + f"{T}<|CHATBOT_TOKEN|>"
    SYSTEM_AND_PROMPT[_name] = (
        command_a_system(_gap, "Be brief.")
        + command_a_turns([("user", "Hi there")])
        + f"{T}<|CHATBOT_TOKEN|>{_prompt}"
    )

PHI_4_SYSTEM = (
    "You are Phi, a language model trained by Microsoft to help users. Your role as an assistant "
    "involves thoroughly exploring questions through a systematic thinking process before "
    "providing the final precise and accurate solutions. This requires engaging in a "
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
TWO_TURNS["phi_4"] = (
    f"<|im_start|>system<|im_sep|>{PHI_4_SYSTEM}<|im_end|>"
    "<|im_start|>user<|im_sep|>Hi there<|im_end|><|im_start|>assistant<|im_sep|>Hello!<|im_end|>"
    "<|im_start|>user<|im_sep|>What is 2+2?<|im_end|><|im_start|>assistant<|im_sep|>4<|im_end|>"
)
SYSTEM_AND_PROMPT["phi_4"] = (
    "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|>Hi there<|im_end|>"
    "<|im_start|>assistant<|im_sep|>"
)


def mistral_v7_system(today: str) -> str:
    return (
        "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French "
        "startup headquartered in Paris.\nYour knowledge base was last updated on 2023-10-01. "
        f"The current date is {today}.\n\nWhen you're not sure about some information, you say "
        "that you don't have the information and don't make up anything.\nIf the user's "
        "question is not clear, ambiguous, or does not provide enough context for you to "
        "accurately answer the question, you do not try to answer it right away and you rather "
        'ask the user to clarify their request (e.g. "What are some good restaurants around '
        'me?" => "Where are you?" or "When is the next flight to Tokyo" => "Where do you travel '
        'from?")'
    )


def mistral_v7_two_turns(today: str) -> str:
    return (
        f"<s>[SYSTEM_PROMPT]{mistral_v7_system(today)}[/SYSTEM_PROMPT]"
        "[INST]Hi there[/INST]Hello!</s>[INST]What is 2+2?[/INST]4</s>"
    )


SYSTEM_AND_PROMPT["mistral_v7_tekken"] = (
    "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi there[/INST]"
)


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tokenizer(320)


def render(tok: Any, name: str, messages: list[dict[str, str]], prompt: bool = False) -> str:
    return str(
        tok.apply_chat_template(
            messages,
            chat_template=CHAT_TEMPLATES[name],
            tokenize=False,
            add_generation_prompt=prompt,
            date_string="26 Jul 2024",  # Llama 3.2's "Today Date" (its default: today)
        )
    )


def test_every_axolotl_name_has_a_template() -> None:
    """The ChatTemplate enum's names, and phi_4: a template of Axolotl's folder that its enum
    lacks (Axolotl reaches it as tokenizer_default_fallback_phi_4)."""
    named = set(AXOLOTL_NAMES) - set(SPECIAL_NAMES)
    assert len(named) == 35
    assert set(FORMATS) == named | {"phi_4"} and set(FORMATS) <= set(CHAT_TEMPLATES)
    assert set(TWO_TURNS) | {"mistral_v7_tekken"} == set(CHAT_TEMPLATES)


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
def test_two_turns_render_the_familys_text(tok: Any, name: str) -> None:
    text = render(tok, name, TWO_TURNS_MESSAGES)
    if name == "mistral_v7_tekken":  # the default system message names today's date
        days = {datetime.date.today(), datetime.date.today() - datetime.timedelta(days=1)}
        assert text in {mistral_v7_two_turns(d.isoformat()) for d in days}
        return
    assert text == TWO_TURNS[name]


@pytest.mark.parametrize("name", sorted(SYSTEM_AND_PROMPT))
def test_a_system_message_and_the_generation_prompt(tok: Any, name: str) -> None:
    assert render(tok, name, SYSTEM_MESSAGES, prompt=True) == SYSTEM_AND_PROMPT[name]


def test_gemma_has_no_system_role_and_roles_alternate(tok: Any) -> None:
    """As Gemma's own template: a system message is refused (gemma3 takes it into the first
    turn); so are two user turns in a row."""
    with pytest.raises(Exception, match="System role not supported"):
        render(tok, "gemma", SYSTEM_MESSAGES)
    with pytest.raises(Exception, match="alternate"):
        render(tok, "gemma3", [TWO_TURNS_MESSAGES[0], TWO_TURNS_MESSAGES[2]])


def test_qwen3_thinks_in_the_last_answer_only(tok: Any) -> None:
    """An earlier answer loses its reasoning; the last keeps it (an empty block when none)."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nHello!"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "<think>\nonce more\n</think>\n\nHello again!"},
    ]
    assert render(tok, "qwen3", messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nonce more\n</think>\n\nHello again!<|im_end|>\n"
    )
