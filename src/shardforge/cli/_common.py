"""What every command shares: `shardforge_command`, the one wrapper of a command's body
(logging, --debug, config overrides collected and checked, user errors printed as one line
with their exit code), and `fire_entry`, its `python -m shardforge.cli.<module>` entry point.

    @shardforge_command("inspect", epilog=EPILOG, params=[click.Argument(["path"]), ...])
    def command(path: str, as_json: bool, overrides: list[str]) -> str:
        # (its docstring is the command's help)
        return do_inspect(path, overrides, as_json)   # the text to print, or None

    do_cli = fire_entry(command)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from shardforge.errors import ShardforgeError, format_error
from shardforge.startup import import_model_code, relaxed_gc

T = TypeVar("T")

OVERRIDES_HELP = (
    "Any config key can be overridden after the config path: `--learning_rate 2e-5`, "
    "`--fsdp.offload_params true` (dots for nested keys), `--bf16` (a bare flag means true)."
)

# Extra arguments (config overrides) are collected instead of rejected.
OVERRIDE_CONTEXT: dict[str, Any] = {
    "ignore_unknown_options": True,
    "allow_extra_args": True,
    "help_option_names": ["-h", "--help"],
}


def load_config(config: str | Path, override_args: Sequence[str] | None, command: str) -> Any:
    """The config at `config` with the override arguments after it, checked for `command`."""
    from shardforge.config import load_cfg, parse_override_args

    return load_cfg(config, command=command, **parse_override_args(list(override_args or [])))


def overrides_name(override_args: Sequence[str] | None, key: str) -> bool:
    """Whether the override arguments set config key `key` (either spelling: `--base_model`,
    `--base-model`)."""
    from shardforge.config import parse_override_args

    return key in parse_override_args(list(override_args or []))


def run_on_model(
    use: Callable[..., T],
    config: str | Path,
    override_args: Sequence[str] | None,
    options: Mapping[str, Any],
    quiet: bool = True,
) -> T:
    """What the commands that use the model a run trained (`inference`, `evaluate`, `lm-eval`,
    `quantize`) share: `config` loaded with the override arguments after it, and
    `use(cfg, named_base=..., **options)` called with the options given (a None: not given),
    transformers' bars and the libraries' warnings off (`quiet`). `named_base`: the overrides
    name `base_model`, as Axolotl's `--base-model DIR` (that folder is the model)."""
    cfg = load_config(config, override_args, "all")
    named_base = overrides_name(override_args, "base_model")
    given = {k: v for k, v in options.items() if v is not None}
    with quiet_libraries(quiet):
        with relaxed_gc():  # the lighter start-up (`shardforge.startup`)
            import_model_code()
        return use(cfg, named_base=named_base, **given)


# what transformers and huggingface_hub read when they are imported: no progress bars, errors only
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
# the libraries whose warnings a quiet command keeps off stderr (shardforge's own lines stay)
QUIET_MODULES = r"(torch|transformers|peft|huggingface_hub|accelerate|safetensors)(\.|$)"


@contextlib.contextmanager
def quiet_libraries(on: bool = True) -> Iterator[None]:
    """While the body runs (`on`), transformers' progress bars ("Loading weights", "Writing
    model shards") and log lines below errors, and the FutureWarnings and UserWarnings the
    libraries raise, do not reach stderr; shardforge's own lines still do. Imports nothing: a
    library imported inside reads `QUIET_ENV`, one imported already is told directly; all is
    as it was afterwards (a command run in a test's process leaves nothing behind)."""
    if not on:
        yield
        return
    saved = {k: os.environ.get(k) for k in QUIET_ENV}
    os.environ.update(QUIET_ENV)
    had = _transformers_state()
    _set_transformers_state((40, False))  # logging.ERROR, no bars
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=QUIET_MODULES)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            # imported inside: its defaults again (huggingface_hub, imported inside too, keeps
            # its bars off and would warn about it here)
            _set_transformers_state(had or (30, True))


def _transformers_state() -> tuple[int, bool] | None:
    """transformers' verbosity and whether its bars show (None: not imported)."""
    tlog = sys.modules.get("transformers.utils.logging")
    if tlog is None:
        return None
    return int(tlog.get_verbosity()), bool(tlog.is_progress_bar_enabled())


def _set_transformers_state(state: tuple[int, bool]) -> None:
    tlog = sys.modules.get("transformers.utils.logging")
    if tlog is not None:
        tlog.set_verbosity(state[0])
        (tlog.enable_progress_bar if state[1] else tlog.disable_progress_bar)()


# loggers that warn at import time about optional kernels the machine lacks (torchao's
# CUDA-only .so files and triton, imported by transformers' quantizers when torchao is
# installed; torch's pytree deprecation notes for those kernels' enums): not the user's concern
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def setup_logging(quiet: bool = False, timed: bool = False) -> None:
    """Log lines on stderr; `timed` (a training rank): each line starts with the time of day,
    `HH:MM:SS ` (how long the compile, an evaluation or a save took shows in the log)."""
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(message)s" if timed else "%(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)


def fail(message: str, code: int = 1, details: Sequence[str] = ()) -> NoReturn:
    """Print `error: <message>` (one line of at most 300 characters, printable) and its
    indented details (at most 20, then "(+N more)") on stderr; exit with `code`."""
    for line in format_error(message, details):
        click.echo(line, err=True)
    raise SystemExit(code)


def os_error_message(exc: OSError) -> str:
    """`<file>: <reason>` for an OSError that reached the command unconverted."""
    where = exc.filename if exc.filename is not None else None
    reason = exc.strerror or type(exc).__name__
    target = f" -> {exc.filename2}" if exc.filename2 is not None else ""
    return f"{where}{target}: {reason}" if where is not None else f"{reason} ({exc})"


def run_guarded(fn: Callable[[], T], debug: bool = False) -> T:
    """Run a command body; a user error (or a file-system error nothing converted) becomes
    `error: ...` on stderr and a non-zero exit."""
    try:
        return fn()
    except ShardforgeError as exc:
        if debug:
            raise
        fail(exc.message, exc.exit_code, exc.details)
    except OSError as exc:
        if debug:
            raise
        fail(f"{os_error_message(exc)} (--debug shows the traceback)", 1)
    except KeyboardInterrupt:
        if debug:
            raise
        fail("interrupted", 130)


def split_debug(args: list[str]) -> tuple[list[str], bool]:
    """Pull a stray `--debug` out of the override arguments."""
    rest = [a for a in args if a != "--debug"]
    return rest, len(rest) != len(args)


def _option_names(command: click.Command) -> list[str]:
    return [o for p in command.params if isinstance(p, click.Option) for o in p.opts]


# accelerate's launcher options (what `axolotl train --num-processes` passes on) -> ours
LAUNCHER_SPELLINGS = {
    "num_processes": "--nproc_per_node",
    "num_machines": "--nnodes",
    "machine_rank": "--node_rank",
    "main_process_ip": "--rdzv_endpoint",
    "main_process_port": "--rdzv_endpoint",
}


def check_options(ctx: click.Context, args: list[str]) -> list[str]:
    """The extra arguments of a command, all of which must be config overrides.

    An argument that names neither an option of the command nor a config key (shardforge's or
    Axolotl's) is an option error with a suggestion among the command's options, so `--verfy`
    reads "no such option --verfy; did you mean --verify?" rather than an unknown config key.
    """
    import difflib

    from shardforge.config.axolotl import known_top_level_keys

    keys = known_top_level_keys()
    options = _option_names(ctx.command)
    for arg in args:
        if not arg.startswith("--") or len(arg) == 2:
            continue
        name = arg[2:].split("=", 1)[0]
        key = name.replace("-", "_").split(".", 1)[0]
        if key in keys:
            continue
        ours = LAUNCHER_SPELLINGS.get(key)
        if ours is not None and ours in options:
            fail(f"no such option --{name} (accelerate's launcher spelling): use {ours}", 2)
        close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.7)
        if close:
            fail(f"no such option --{name}; did you mean {close[0]}?", 2)
        near = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.75)
        hint = f"; did you mean the config key --{near[0]}?" if near else ""
        fail(
            f"no such option --{name} (neither an option of `{ctx.command.name}` nor a config "
            f"key){hint}\n  see `shardforge {ctx.command.name} --help` and docs/config.md",
            2,
        )
    return args


def spelled(name: str, **kwargs: Any) -> click.Option:
    """A click option taking both spellings users type: `--node_rank` and `--node-rank`."""
    dashed = name.replace("_", "-")
    flags = [f"--{name}", f"--{dashed}"] if dashed != name else [f"--{name}"]
    return click.Option([*flags, name], **kwargs)


def debug_option() -> click.Option:
    """`--debug`: show the traceback of a user error instead of the one-line message."""
    return click.Option(["--debug"], is_flag=True, help="Show a traceback on errors.")


def config_argument() -> click.Argument:
    """CONFIG: the YAML config a command reads."""
    return click.Argument(["config"], type=click.Path(dir_okay=False))


def shardforge_command(
    name: str,
    *,
    epilog: str,
    params: Sequence[click.Parameter] = (),
    overrides: bool = True,
    rank_logging: bool = False,
    request: type | None = None,
) -> Callable[[Callable[..., str | None]], click.Command]:
    """The click command `name` around `body`, whose docstring is its help (with
    `OVERRIDES_HELP` after it when it takes config overrides), and which takes its parameters (plus
    `overrides`, the config override arguments after them, when the command takes them, and
    `debug` if it names it) and returns the text to print on stdout, or None.

    What every command does around its body is here: `--debug` (also a stray one among the
    overrides), the overrides checked (a mistyped option is an option error), logging on
    stderr (`rank_logging`: quiet on ranks other than 0), and a user error printed as one
    `error:` line with its exit code. `request`: a request dataclass whose option fields are
    options of the command, after `params` (`request_options`)."""

    def wrap(body: Callable[..., str | None]) -> click.Command:
        wants_debug = "debug" in inspect.signature(body).parameters

        def callback(debug: bool, **values: Any) -> None:
            ctx = click.get_current_context()
            if overrides:
                args, stray = split_debug(list(ctx.args))
                values["overrides"] = check_options(ctx, args)
                debug = debug or stray
            if wants_debug:
                values["debug"] = debug
            setup_logging(quiet=rank_logging and os.environ.get("RANK", "0") != "0")
            text = run_guarded(lambda: body(**values), debug)
            if text is not None:
                click.echo(text, nl=False)

        settings = OVERRIDE_CONTEXT if overrides else {"help_option_names": ["-h", "--help"]}
        return click.Command(
            name,
            callback=callback,
            params=[*params, *(request_options(request) if request else ()), debug_option()],
            context_settings=settings,
            epilog=epilog,
            help=" ".join((inspect.getdoc(body) or "").split())
            + (" " + OVERRIDES_HELP if overrides else ""),
        )

    return wrap


def request_options(cls: type) -> list[click.Option]:
    """The click options of request dataclass `cls`, one per option field on the command line
    (see `shardforge.merge.options`): its spellings, type, choices, flag and help."""
    from shardforge.merge.options import flags, help_text, is_flag, option_fields, option_of

    out = []
    for f in option_fields(cls):
        opt = option_of(f)
        if not opt.cli:
            continue
        kind: Any = click.Choice(opt.choices) if opt.choices else opt.type
        default = f.default if is_flag(f) or opt.choices else None
        out.append(
            click.Option(
                [*flags(f), f.name],
                type=kind,
                default=default,
                is_flag=True if is_flag(f) and not f.default else None,
                multiple=opt.multiple,
                metavar=opt.metavar,
                help=help_text(f),
            )
        )
    return out


def _fire_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return ",".join(map(str, value))
    return str(value)


def fire_argv(command: click.Command, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str]:
    """The command line that `python -m` with fire's parsed `args` and `kwargs` stands for:
    `--output_path out` for the command's options (a flag as itself, or its negation), and
    the other `--key value` as config overrides."""
    by_key: dict[str, tuple[click.Option, bool]] = {}
    for p in command.params:
        if isinstance(p, click.Option):
            for o in p.opts:
                by_key[o.lstrip("-").replace("-", "_")] = (p, True)
            for o in p.secondary_opts:
                by_key[o.lstrip("-").replace("-", "_")] = (p, False)
    argv = [_fire_text(a) for a in args]
    for key, value in kwargs.items():
        found = by_key.get(key.replace("-", "_"))
        if found is None:  # a config override
            argv += [f"--{key}", _fire_text(value)]
        elif found[0].is_flag:
            p, primary = found
            on = bool(value) == primary
            argv += [p.opts[0]] if on else p.secondary_opts[:1]
        elif found[0].multiple and isinstance(value, list | tuple):
            for one in value:
                argv += [found[0].opts[0], _fire_text(one)]
        else:
            argv += [found[0].opts[0], _fire_text(value)]
    return argv


def fire_entry(command: click.Command) -> Callable[..., None]:
    """The fire entry point of `command` (`python -m shardforge.cli.<module> ARGS`): fire's
    arguments as that command line, run by `command` (same options, output and exit codes)."""

    def do_cli(*args: Any, **kwargs: Any) -> None:
        command.main(fire_argv(command, args, kwargs), prog_name=f"shardforge {command.name}")

    do_cli.__doc__ = f"fire entry point of `shardforge {command.name}`."
    return do_cli
