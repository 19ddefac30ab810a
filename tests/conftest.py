"""Shared test setup: everything offline, tokenizers single-threaded; every test that starts a
child process is marked `slow`.

`slow` marks the tests that start processes (subprocesses, torchrun, spawned gloo ranks): they
stay in `make test`; `pytest -m "not slow"` is the quick in-process run. It is enforced here: a
test fails when a child process is started while it runs or while its fixtures are set up,
unless it is marked `slow` (a decorator, or `pytestmark = pytest.mark.slow` in its module).
A test that uses a fixture whose setup started processes must be marked too, even when another
test set that fixture up (a module or session fixture is set up once, by whichever test comes
first: the rule must not depend on the order). A fixture's teardown is not checked (it runs
after whichever test happens to be last).

Tests in files that others are editing while this rule was introduced are marked from here,
in `SLOW_ELSEWHERE`; move each into its file (a decorator or `pytestmark`) when you next edit it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from helpers import children

# the loopback S3 server (`s3_server`, one per test process) of the object-storage tests
pytest_plugins = ("helpers.s3",)


@pytest.fixture(scope="session", autouse=True)
def _temp_folders_under_pytests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The temporary folders the code and its child processes make (staging areas, rank
    scratch, torchrun's, a killed merge's leftovers) go under this session's pytest folder,
    which pytest removes after a green run (tmp_path_retention_policy), not into /tmp."""
    folder = tmp_path_factory.mktemp("TMPDIR")
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # read TMPDIR again
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved
        tempfile.tempdir = None


# importing torch._dynamo (transformers' model code does) makes /tmp/torchinductor_<user>, the
# compiler's cache, and leaves it: this run's processes (the workers inherit it) use a folder
# removed when the process that made it exits
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR = tempfile.mkdtemp(prefix="shardforge-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR
    atexit.register(shutil.rmtree, _INDUCTOR, ignore_errors=True)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# tests that start child processes in files others were editing when the rule came:
# a module, or module::test (all its parameters) -> what it starts
SLOW_ELSEWHERE: dict[str, str] = {
    "tests/cli/test_config_schema.py::test_fire_module_entry_point": "python -m",
    "tests/cli/test_error_lines.py::test_disk_full_and_read_only_file_system": "unshare",
    "tests/cli/test_inspect_cli.py::test_config_argument_with_override": "built: gloo ranks",
    "tests/cli/test_inspect_cli.py::test_human_report_header_and_table": "built: gloo ranks",
    "tests/cli/test_inspect_cli.py::test_json_parses_and_is_all_of_stdout": "built: gloo ranks",
    "tests/cli/test_inspect_cli.py::test_module_entry_point_json_and_step": "python -m",
    "tests/cli/test_inspect_cli.py::test_optimizer_directory_points_to_the_model": "built",
    "tests/cli/test_inspect_cli.py::test_unknown_step_lists_the_steps": "built: gloo ranks",
    "tests/cli/test_main.py::test_console_entry_point_reports_errors_with_their_status": "python",
    "tests/cli/test_main.py::test_debug_shows_the_traceback": "the console script",
    "tests/cli/test_main.py::test_exit_now_flushes_runs_exit_handlers_and_keeps_the_status": "-c",
    "tests/cli/test_main.py::test_installed_console_script_runs_in_a_subprocess": "the script",
    "tests/cli/test_main.py::test_python_dash_m_shardforge": "python -m shardforge",
    "tests/cli/test_main.py::test_typo_exits_2_with_one_line_and_no_traceback": "the script",
    "tests/cli/test_merge_cli.py::test_python_module_entry_point": "python -m",
    "tests/cli/test_merge_cli.py::test_real_cli_refusals_in_a_subprocess": "python -m shardforge",
    "tests/cli/test_merge_cli.py::test_the_merge_does_not_import_training_code": "python -c",
    "tests/cli/test_merge_lora_cli.py::test_python_module_entry_point": "python -m",
    "tests/cli/test_train_cli.py::test_python_module_entry_point_reports_errors_in_one_line": "-m",
    "tests/cli/test_validate.py::test_fire_module_entry_point": "python -m",
    "tests/cli/test_validate.py::test_fire_module_reports_errors_without_traceback": "python -m",
    "tests/io/test_unpickler.py::test_bombs_stay_within_100_mb": "python -c",
    "tests/merge/test_api.py": "built: gloo ranks",
    "tests/train/test_async_save.py": "shardforge train under torchrun",
    "tests/train/test_checkpointing.py::test_a_damaged_checkpoint_is_named_and_auto_falls_back": (
        "reference: shardforge train under torchrun"
    ),
    "tests/train/test_checkpointing.py::test_a_larger_max_steps_continues_the_lr_without_a_jump": (
        "reference: shardforge train under torchrun"
    ),
    "tests/train/test_checkpointing.py::test_a_named_damaged_checkpoint_is_one_error": "reference",
    "tests/train/test_checkpointing.py::test_dcp_model_holds_plain_hf_keys_and_the_trained_weights": (
        "reference: shardforge train under torchrun"
    ),
    "tests/train/test_checkpointing.py::test_hsdp_trains_resumes_and_merges_like_full_shard": (
        "shardforge train under torchrun"
    ),
    "tests/train/test_checkpointing.py::test_kill_9_during_save_resumes_from_the_last_complete_checkpoint": (
        "shardforge train under torchrun"
    ),
    "tests/train/test_checkpointing.py::test_layout_matches_the_merge_contract": "reference",
    "tests/train/test_checkpointing.py::test_resume_continues_like_an_uninterrupted_run": "torchrun",
    "tests/train/test_checkpointing.py::test_resume_falls_back_past_a_damaged_latest_checkpoint": (
        "shardforge train under torchrun"
    ),
    "tests/train/test_checkpointing.py::test_resuming_a_finished_run": "reference: torchrun",
    "tests/train/test_diagnostics.py::test_a_run_starts_with_the_sharding_and_logs_phase_memory": (
        "shardforge train under torchrun"
    ),
    "tests/train/test_eval.py::test_eval_loss_is_the_same_at_one_and_two_ranks": "torchrun",
    "tests/train/test_loop.py": "shardforge train under torchrun",
    "tests/train/test_lora.py": "shardforge train under torchrun",
    "tests/train/test_merge_on_save.py": "the merges run as subprocesses",
    "tests/train/test_model.py::test_sharded_load_equals_the_base_model_on_two_ranks": "gloo ranks",
    "tests/train/test_packing.py::test_packed_training_runs_on_two_ranks": "torchrun",
    "tests/train/test_preflight.py::test_an_error_found_by_the_ranks_is_printed_once_as_the_last_line": (
        "shardforge train under torchrun"
    ),
    "tests/train/test_preflight.py::test_bad_config_fails_before_launch": "shardforge train",
    "tests/train/test_tracking.py::test_a_resumed_run_records_every_step_once": "tracked: torchrun",
    "tests/train/test_tracking.py::test_tensorboard_and_offline_wandb_hold_the_logged_metrics": (
        "tracked: shardforge train under torchrun"
    ),
}

_STARTERS = pytest.StashKey[dict[Any, str]]()  # fixture definition -> the first start in it


def pytest_configure(config: pytest.Config) -> None:
    children.install()
    config.stash[_STARTERS] = {}
    # a plugin, not a hook of this conftest: a conftest's hooks miss the fixtures of the
    # session (their node is the root directory, outside tests/)
    config.pluginmanager.register(_FixtureWatcher(config), "shardforge-fixture-children")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        test = item.nodeid.split("[")[0]
        if test in SLOW_ELSEWHERE or test.split("::")[0] in SLOW_ELSEWHERE:
            item.add_marker(pytest.mark.slow)


class _FixtureWatcher:
    """Records the fixture definitions whose setup started a child process."""

    def __init__(self, config: pytest.Config) -> None:
        self.starters = config.stash[_STARTERS]

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any]) -> Generator[Any]:
        with children.watching() as started:
            try:
                return (yield)
            finally:
                if started:
                    self.starters.setdefault(fixturedef, started[0])


def _unmarked(item: pytest.Item, started: list[str]) -> None:
    if item.get_closest_marker("slow") is not None:
        return
    if started:
        pytest.fail(
            f"{item.nodeid} starts a child process but is not marked slow: {started[0]}\n"
            "mark it @pytest.mark.slow (or its module: pytestmark = pytest.mark.slow)",
            pytrace=False,
        )
    starters = item.config.stash[_STARTERS]
    for name, fixturedef in _fixtures(item):
        if fixturedef in starters:
            pytest.fail(
                f"{item.nodeid} uses the fixture {name!r}, which starts child processes "
                f"({starters[fixturedef]}), but is not marked slow",
                pytrace=False,
            )


def _fixtures(item: pytest.Item) -> list[tuple[str, Any]]:
    """The fixture definitions the test uses: those it names (directly or through other
    fixtures) and those it asked for while running (`request.getfixturevalue`)."""
    info = getattr(item, "_fixtureinfo", None)
    named = [(n, d[-1]) for n, d in (info.name2fixturedefs.items() if info else ()) if d]
    asked = getattr(getattr(item, "_request", None), "_fixture_defs", {})
    return named + list(asked.items())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None]:
    with children.watching() as started:
        result = yield
    _unmarked(item, started)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None]:
    with children.watching() as started:
        result = yield
    _unmarked(item, started)
    return result
