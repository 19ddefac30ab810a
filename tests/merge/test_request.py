"""MergeRequest is the only list of the merge's options: the command's options and --help, the
keywords, signature and docstring of `merge_fsdp_weights` and the table of
docs/merge-options.md are made from its fields; every conflict is reported at once."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from shardforge import merge_fsdp_weights
from shardforge.cli.merge_sharded_fsdp_weights import command
from shardforge.errors import MergeError
from shardforge.merge.options import flags, help_text, markdown_table, option_fields, option_of
from shardforge.merge.request import OPTION_NAMES, LoraMergeRequest, MergeRequest

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- BEGIN generated: the fields of MergeRequest"
END = "<!-- END generated -->"


def _cli_fields(cls: type) -> list[Any]:
    return [f for f in option_fields(cls) if option_of(f).cli]


def _options(cmd: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in cmd.params if isinstance(p, click.Option) and p.name}


def _error(**options: Any) -> MergeError:
    with pytest.raises(MergeError) as info:
        MergeRequest(**options)
    return info.value


def test_every_conflict_is_reported_at_once() -> None:
    err = _error(
        output_path=None,
        output_format="safetensors",
        max_shard_size="5GB",
        average_last=2,
        average_steps="1,x",
        step=3,
    )
    assert err.message == "4 conflicting merge options:"
    assert err.details == [
        "- --average_steps '1,x': expected step numbers like 100,200,300",
        "- --output_path is required with --format safetensors",
        "- --max_shard_size does not apply to --format safetensors",
        "- --step picks one checkpoint; with averaging list --average_steps",
    ]
    # one problem keeps its own words as the message
    one = _error(output_path="out", average_last=2, average_steps=[1, 2])
    assert one.message == "give --average_last or --average_steps, not both" and not one.details


def test_the_docs_example_of_two_conflicts_is_what_the_request_says() -> None:
    err = _error(output_format="torch", max_shard_size="1GB", step=1, average_last=2)
    shown = "\n".join(err.lines())
    docs = (ROOT / "docs" / "merge-options.md").read_text()
    assert f"```text\n{shown}\n```" in docs


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"all_steps": True, "step": 1, "remove_checkpoint_dir": True}, "cannot be combined"),
        ({"steps": [1, 1]}, "--steps: a step is listed twice"),
        ({"average_steps": (2, 2)}, "--average_steps: a step is listed twice"),
        ({"engine": "fast"}, "--engine 'fast': expected one of stream, transformers"),
        ({"output_format": "gguf"}, "--format 'gguf': expected one of hf, safetensors, torch"),
        ({"average_last": 0}, "--average_last 0: expected a count of at least 1"),
        ({"nproc_per_node": 0}, "--nproc_per_node 0: expected 1 or more"),
        ({"nproc_per_node": 2, "dry_run": True}, "a distributed merge (--nproc_per_node"),
        ({"group": object(), "nproc_per_node": 2}, "give one or the other"),
        ({"group": object(), "output_format": "torch"}, "on a process group writes --format hf"),
    ],
)
def test_each_rule_keeps_its_words(options: dict[str, Any], words: str) -> None:
    assert words in str(_error(**{"output_path": "out", **options}))


def test_values_are_parsed_from_the_command_line_or_python() -> None:
    cli = MergeRequest("out", steps="100, 200", max_shard_size="1000", nnodes=1)
    assert cli.steps == (100, 200) and cli.max_shard_size == 1000 and cli.nnodes == "1"
    assert not cli.distributed and cli.output_path == Path("out").absolute()
    python = MergeRequest("out", average_steps=[3, 1], max_shard_size="5GB")
    assert python.average_steps == (3, 1) and python.max_shard_size == "5GB"
    assert MergeRequest("out", steps=None).steps == ()


def test_the_command_options_are_the_fields() -> None:
    options = _options(command)
    assert set(options) - {"debug"} == {f.name for f in _cli_fields(MergeRequest)}
    for f in _cli_fields(MergeRequest):
        opt = options[f.name]
        assert opt.help == help_text(f), f.name
        spelled = [s for flag in flags(f) for s in flag.split("/")]
        assert set(spelled) == {*opt.opts, *opt.secondary_opts}, f.name
    assert "group" not in options  # a Python keyword only
    assert options["node_rank"].help == "This machine's rank. Passed to torchrun."
    assert {"--output_path", "--output-path", "--format", "--no-save-tokenizer"} <= {
        s for o in options.values() for s in (*o.opts, *o.secondary_opts)
    }


def test_both_spellings_and_parsing_reach_the_request() -> None:
    args = ["cfg.yml", "--output-path", "o", "--max-shard-size", "1000", "--no_save_tokenizer"]
    args += ["--format", "hf", "--steps", "1,2", "--dry-run", "--nproc_per_node", "1"]
    args += ["--keep_dtype", "router", "--keep-dtype", "layers.*.gate"]
    ctx = command.make_context("merge-sharded-fsdp-weights", args)
    values = {k: v for k, v in ctx.params.items() if k in OPTION_NAMES}
    request = MergeRequest(**values)
    assert request.output_path == Path("o").absolute() and request.max_shard_size == 1000
    assert request.steps == (1, 2) and request.dry_run and not request.save_tokenizer
    assert request.keep_dtype == ("router", "layers.*.gate")
    none = command.make_context("merge-sharded-fsdp-weights", ["cfg.yml"]).params
    assert MergeRequest("o", keep_dtype=none["keep_dtype"]).keep_dtype == ()


def test_keep_dtype_takes_a_string_or_a_list_and_checks_each_pattern() -> None:
    assert MergeRequest("out", keep_dtype="norm").keep_dtype == ("norm",)
    assert MergeRequest("out", keep_dtype=["a", "b*"]).keep_dtype == ("a", "b*")
    assert "--keep_dtype '(': not a pattern" in str(_error(output_path="o", keep_dtype=["a", "("]))
    assert "expected a string or a list" in str(_error(output_path="o", keep_dtype=[3]))


def test_help_is_the_field_help() -> None:
    text = CliRunner().invoke(command, ["--help"], terminal_width=1000).output
    for f in _cli_fields(MergeRequest):
        assert help_text(f) in text, f.name


def test_the_python_keywords_are_the_fields() -> None:
    params = inspect.signature(merge_fsdp_weights).parameters
    assert list(params) == ["cfg", *OPTION_NAMES]
    for f in option_fields(MergeRequest):
        assert params[f.name].default == f.default, f.name
        assert " ".join(help_text(f).split()[:4]) in " ".join(
            (merge_fsdp_weights.__doc__ or "").split()
        ), f.name
    assert params["checkpoint"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["output_path"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_an_unknown_keyword_is_a_type_error_with_a_suggestion(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"'verfy'; did you mean 'verify'\?"):
        merge_fsdp_weights(tmp_path / "cfg.yml", tmp_path / "out", verfy=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'$"):
        merge_fsdp_weights(tmp_path / "cfg.yml", tmp_path / "out", zzz=1)
    assert not (tmp_path / "out").exists()


def test_a_group_without_a_process_group_is_refused(tmp_path: Path) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    cfg = {"base_model": str(tmp_path / "base"), "output_dir": str(tmp_path / "run")}
    with pytest.raises(MergeError, match=r"no torch\.distributed process group is initialised"):
        merge_fsdp_weights(cfg, tmp_path / "out", group=object())


def test_the_docs_table_is_made_from_the_fields() -> None:
    text = (ROOT / "docs" / "merge-options.md").read_text()
    start = text.index("\n", text.index(BEGIN)) + 1
    assert text[start : text.index(END)] == markdown_table(MergeRequest), (
        "docs/merge-options.md is stale: replace its table with the output of\n  python -c "
        "'from shardforge.merge.options import markdown_table; from shardforge.merge.request "
        'import MergeRequest; print(markdown_table(MergeRequest), end="")\''
    )


def test_merge_lora_options_are_its_request_fields() -> None:
    from shardforge.cli.merge_lora import command as merge_lora

    options = _options(merge_lora)
    assert set(options) - {"debug"} == {f.name for f in _cli_fields(LoraMergeRequest)}
    assert LoraMergeRequest(max_shard_size="2000").max_shard_size == 2000
    assert "--no_save_tokenizer" in options["save_tokenizer"].secondary_opts


def test_every_format_value_names_a_sink() -> None:
    from shardforge.merge.request import OUTPUT_FORMATS
    from shardforge.sinks.registry import SINKS

    assert tuple(SINKS) == OUTPUT_FORMATS
