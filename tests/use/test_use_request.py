"""The options of `inference` and `evaluate`: one model source at most, generation options in
range, sampling options only with --do_sample; transformers' keywords."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardforge.errors import ShardforgeError
from shardforge.use.request import (
    DEFAULT_MAX_NEW_TOKENS,
    InferenceRequest,
    ModelRequest,
    QuantizeRequest,
)


def test_greedy_by_default_with_transformers_names() -> None:
    assert InferenceRequest(prompt="hi").generation_kwargs() == {
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
        "do_sample": False,
    }
    sampled = InferenceRequest(
        do_sample=True, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1
    )
    assert sampled.generation_kwargs() == {
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
    }
    # repetition_penalty applies to greedy decoding too
    assert InferenceRequest(repetition_penalty=1.2, max_new_tokens=5).generation_kwargs() == {
        "max_new_tokens": 5,
        "do_sample": False,
        "repetition_penalty": 1.2,
    }


def test_paths_are_made_absolute() -> None:
    request = ModelRequest(model_dir="out/merged")  # type: ignore[arg-type]
    assert request.model_dir == Path("out/merged").absolute()


@pytest.mark.parametrize(
    "options,message",
    [
        ({"model_dir": "m", "lora_model_dir": "a"}, r"^--model_dir and --lora_model_dir each name"),
        ({"model_dir": "m", "step": 3}, r"^--model_dir and --checkpoint/--step each name the"),
        ({"step": -1}, r"^--step -1: expected a step number"),
    ],
)
def test_one_model_source(options: dict[str, object], message: str) -> None:
    with pytest.raises(ShardforgeError, match=message):
        ModelRequest(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options,message",
    [
        ({"prompt": " \n"}, r"^empty prompt: give --prompt TEXT or the prompt on standard input"),
        ({"max_new_tokens": 0}, r"^--max_new_tokens 0: expected 1 or more"),
        ({"do_sample": True, "temperature": 0.0}, r"^--temperature 0.0: expected a value above 0"),
        ({"do_sample": True, "top_p": 1.5}, r"^--top_p 1.5: expected a value in \(0, 1\]"),
        ({"do_sample": True, "top_k": -1}, r"^--top_k -1: expected 0 or more"),
        ({"do_sample": True, "min_p": 2.0}, r"^--min_p 2.0: expected a value in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, r"^--repetition_penalty 0.0: expected a value above 0"),
        (
            {"temperature": 0.8, "top_p": 0.9},
            r"^--temperature, --top_p only apply to sampling: add --do_sample",
        ),
    ],
)
def test_bad_generation_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(ShardforgeError, match=message):
        InferenceRequest(**options)  # type: ignore[arg-type]


def test_every_problem_at_once() -> None:
    with pytest.raises(ShardforgeError) as info:
        InferenceRequest(model_dir="m", step=2, max_new_tokens=0)  # type: ignore[arg-type]
    assert info.value.message == "2 conflicting options:"
    assert [d.split(":")[0] for d in info.value.details] == [
        "- --model_dir and --checkpoint/--step each name the model; give one of them",
        "- --max_new_tokens 0",
    ]


@pytest.mark.parametrize(
    "page,request_class",
    [
        ("inference.md", InferenceRequest),
        ("evaluate.md", ModelRequest),
        ("inference.md", QuantizeRequest),
    ],
)
def test_the_docs_tables_are_made_from_the_fields(page: str, request_class: type) -> None:
    from shardforge.merge.options import markdown_table

    text = (Path(__file__).resolve().parents[2] / "docs" / page).read_text()
    assert markdown_table(request_class) in text, (
        f"docs/{page} is stale: replace its options table with the output of\n  python -c "
        "'from shardforge.merge.options import markdown_table; from shardforge.use.request "
        f"import {request_class.__name__}; print(markdown_table({request_class.__name__}))'"
    )


def test_chat_and_gradio_exclude_each_other_and_take_sampling_options() -> None:
    with pytest.raises(ShardforgeError, match="--chat and --gradio are exclusive"):
        InferenceRequest(chat=True, gradio=True)
    with pytest.raises(ShardforgeError, match="--prompt with --gradio: the prompts are typed"):
        InferenceRequest(gradio=True, prompt="Hi")
    # the chat samples by default: its starting settings need no --do_sample
    assert InferenceRequest(chat=True, temperature=0.5, top_k=3).temperature == 0.5
