"""The tests mirror src/: a module `src/shardforge/a/b.py` has its tests in `tests/a/test_b.py`,
or an entry in `TESTED_ELSEWHERE` saying where it is tested instead and why.

`__init__.py`, `__main__.py` and `version.py` need neither. A new module without a test file
fails here: add `tests/a/test_b.py`, or a line below. An entry fails too once its module is
gone or has its own test file, or when the file it names does not exist, so the list stays
true. (pytest imports test files by their base name: two test files of one name in different
folders clash, which is why some tests of `merge/` carry a longer name.)
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "shardforge"
EXEMPT = {"__init__.py", "__main__.py", "version.py"}

# module (relative to src/shardforge) -> "the test file that exercises it: why not its own"
TESTED_ELSEWHERE: dict[str, str] = {
    "config/axolotl_rows.py": "tests/config/test_axolotl_status.py: the rows, through the tables",
    "config/axolotl_top_level.py": "tests/config/test_axolotl_status.py: the table, one of two",
    "config/axolotl_top_level_m.py": "tests/config/test_axolotl_status.py: the table, one of two",
    "io/s3_adapter.py": "tests/sinks/test_uploads.py: failures told apart by type and code, on the server",
    "config/paths.py": "tests/config/test_loader.py: the object-storage path check, per key",
    "config/schema_data.py": "tests/config/test_schema.py: ShardforgeConfig's mixins, as one",
    "config/schema_fsdp.py": "tests/config/test_schema.py: ShardforgeConfig's mixins, as one",
    "config/schema_lora.py": "tests/config/test_schema.py: ShardforgeConfig's mixins, as one",
    "config/schema_model.py": "tests/config/test_schema.py: ShardforgeConfig's mixins, as one",
    "config/schema_train.py": "tests/config/test_schema.py: ShardforgeConfig's mixins, as one",
    "train/chat.py": "tests/train/test_data_templates.py: rendered chats, through train.data",
    "train/mixing.py": "tests/train/test_data_axolotl_keys.py: merged, filtered and sharded rows",
    "train/rows.py": "tests/train/test_data_axolotl_keys.py: the rows' keys, through train.data",
    "train/best.py": "tests/train/test_training_option_runs.py: early stop, best model, a run",
    "train/freeze.py": "tests/train/test_training_options.py: unfrozen_parameters, a Trainer",
    "train/hooks.py": "tests/train/test_loop.py: a callback at every seam of the loop",
    "train/options.py": "tests/train/test_training_options.py: each option, a set-up Trainer",
    "train/precision.py": "tests/train/test_training_options.py: qat, fp8, fp32_norms, dtypes",
    "errors.py": "tests/cli/test_error_lines.py: format_error and the one-line rule, as printed",
    "cli/_common.py": "tests/cli/test_error_lines.py: the shared wrapper, through every command",
    "cli/evaluate.py": "tests/cli/test_evaluate_cli.py: test_evaluate.py is tests/use/'s name",
    "cli/inference.py": "tests/cli/test_inference_cli.py: test_inference.py is tests/use/'s",
    "cli/lm_eval.py": "tests/use/test_lm_evaluation.py: the command beside the lm_eval one",
    "cli/quantize.py": "tests/use/test_quantize.py: the command, its output loaded",
    "config/schema_use.py": "tests/use/test_gradio_page.py: its keys, as the commands use them",
    "cli/inspect.py": "tests/cli/test_inspect_cli.py: named after the command",
    "cli/merge_lora.py": "tests/cli/test_merge_lora_cli.py: named after the command",
    "cli/merge_rank.py": "tests/merge/test_distributed.py: the entry of each torchrun merge rank",
    "cli/merge_sharded_fsdp_weights.py": "tests/cli/test_merge_cli.py: named after the command",
    "cli/preprocess.py": "tests/cli/test_preprocess_cli.py: named after the command",
    "cli/train.py": "tests/cli/test_train_cli.py: named after the command",
    "cli/verify.py": "tests/cli/test_verify_cli.py: test_verify.py is tests/sinks/'s name",
    "cli/train_rank.py": "tests/train/test_launch.py: the entry of each torchrun training rank",
    "config/axolotl_keys.py": "tests/config/test_axolotl.py: the key table, with its users",
    "config/errors.py": "tests/config/test_loader.py: pydantic errors as the user's key lines",
    "config/schema_optim.py": "tests/train/test_optim.py: each key against the lr or groups",
    "config/peft.py": "tests/merge/test_lora_checkpoint.py: the LoraConfig training and merge share",
    "formats/accelerate_bin/format.py": "tests/formats/accelerate_bin/test_accelerate_bin.py: "
    "the row on real saves (test_format.py would clash)",
    "formats/base.py": "tests/formats/test_contract.py: the protocol, run on every row",
    "formats/dcp/chunks.py": "tests/formats/dcp/test_metadata.py: chunk reads on real chunks",
    "formats/dcp/format.py": "tests/formats/test_contract.py: the DCP row of the contract",
    "formats/dcp/pickles.py": "tests/formats/dcp/test_dcp_pickles.py: test_pickles.py would clash",
    "formats/dcp/reference.py": "tests/formats/test_contract.py: the reference reader per row",
    "formats/dcp/source.py": "tests/formats/test_sources.py: DCP sources beside the others",
    "formats/dcp_ranks/format.py": "tests/formats/dcp_ranks/test_rank_metadata.py: the row on "
    "real saves (test_format.py would clash)",
    "formats/dcp_safetensors/format.py": "tests/formats/dcp_safetensors/test_sharded.py: the "
    "row on real saves, both forms (test_format.py would clash)",
    "formats/dcp_safetensors/names.py": "tests/formats/dcp_safetensors/test_sharded.py: the "
    "shard file names (incomplete and mixed saves)",
    "formats/dcp_safetensors/reference.py": "tests/formats/test_contract.py: the reference per row",
    "formats/rankfiles/format.py": "tests/formats/test_contract.py: the rank-files row",
    "formats/rankfiles/names.py": "tests/formats/rankfiles/test_rank_file.py: the file names",
    "formats/rankfiles/pickles.py": "tests/formats/rankfiles/test_rank_pickles.py: name clash",
    "formats/rankfiles/reference.py": "tests/formats/test_contract.py: the reference per row",
    "formats/rankfiles/source.py": "tests/formats/rankfiles/test_rank_memory.py: reads, memory",
    "formats/reference.py": "tests/sinks/test_verify_independent.py: the verifier's helpers",
    "formats/safetensors/format.py": "tests/formats/test_contract.py: the safetensors row",
    "formats/safetensors/reader.py": "tests/formats/safetensors/test_safetensors_reader.py: clash",
    "formats/safetensors/reference.py": "tests/formats/test_contract.py: the reference per row",
    "formats/state.py": "tests/merge/test_remove.py: optimizer and training state refused",
    "formats/registry.py": "tests/formats/test_contract.py: every row of the registry",
    "io/fs.py": "tests/io/test_publish.py: fsync and preallocation under the atomic outputs",
    "io/pickle_data.py": "tests/io/test_unpickler.py: the records and values the engine gives",
    "layouts/layout.py": "tests/layouts/test_catalog.py: each row, through the catalog",
    "keymap/lora.py": "tests/keymap/test_lora_names.py: test_lora.py is tests/train/'s name",
    "keymap/lora_settings.py": "tests/keymap/test_lora_names.py: the names and settings of one adapter",
    "keymap/names.py": "tests/merge/test_merge_sources.py: name adapters on torchtitan steps",
    "keymap/titan/tables.py": "tests/keymap/titan/test_adapter.py: the tables, via the adapter",
    "merge/dtypes.py": "tests/merge/test_api.py: dtype choices (test_dtypes.py is tests/io/'s)",
    "merge/launch.py": "tests/merge/test_launch_merge.py: test_launch.py is tests/train/'s name",
    "merge/locate.py": "tests/merge/test_merge_sources.py: what each layout's merge reads",
    "merge/lora.py": "tests/merge/test_merge_lora.py: test_lora.py is tests/train/'s name",
    "merge/lora_fuse.py": "tests/merge/test_merge_lora.py: every fuse problem through merge_lora",
    "merge/lora_params.py": "tests/merge/test_merge_lora.py: LoRAs on fused experts vs peft",
    "merge/on_ranks.py": "tests/merge/test_distributed.py: the merge on gloo ranks",
    "merge/options.py": "tests/merge/test_request.py: the option metadata of the request",
    "merge/plan_report.py": "tests/merge/test_merge_sources.py: --dry_run's report",
    "merge/prepare.py": "tests/merge/test_api.py: every merge prepares through it",
    "merge/run.py": "tests/merge/test_api.py: the single-process pipeline",
    "sinks/base.py": "tests/merge/test_lora_checkpoint.py: describe (--dry_run) per sink",
    "sinks/companions.py": "tests/merge/test_api.py: config, generation config and tokenizer",
    "sinks/engine.py": "tests/merge/test_api.py: --engine transformers equals the stream",
    "sinks/hf_dir.py": "tests/merge/test_api.py: every merge's HF directory output",
    "sinks/progress.py": "tests/cli/test_merge_cli.py: the merge command, bar on or --quiet",
    "sinks/registry.py": "tests/merge/test_request.py: --format values name its sinks",
    "sinks/safetensors_files.py": "tests/formats/dcp/test_metadata.py: files filled from chunks",
    "train/dtensors.py": "tests/train/test_optimizers.py: low-bit and GaLore states resharded",
    "train/optim_groups.py": "tests/train/test_optim.py: the groups through build_optimizer",
    "train/optim_lowbit.py": "tests/train/test_optimizers.py: resumes of every low-bit optimizer",
    "train/optim_state.py": "tests/train/test_optimizers.py: every optimizer's checkpoint",
    "train/saving.py": "tests/train/test_checkpointing.py: saves, async saves and rotation",
    "train/schedules.py": "tests/train/test_optim.py: schedules and optimizers, one table test",
    "train/torchrun.py": "tests/train/test_launch.py: the torchrun command line",
    "use/model.py": "tests/use/test_use_model.py: test_model.py is tests/train/'s name",
    "use/request.py": "tests/use/test_use_request.py: test_request.py is tests/merge/'s name",
}


def _modules() -> list[str]:
    return sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if p.name not in EXEMPT)


def _mirror(module: str) -> Path:
    path = Path(module)
    return ROOT / "tests" / path.parent / f"test_{path.name}"


def test_every_module_has_its_test_file_or_says_where_it_is_tested() -> None:
    missing = [
        f"src/shardforge/{m}: add {_mirror(m).relative_to(ROOT)} or an entry in TESTED_ELSEWHERE"
        for m in _modules()
        if not _mirror(m).is_file() and m not in TESTED_ELSEWHERE
    ]
    assert not missing, "\n".join(missing)


def test_every_entry_is_still_true() -> None:
    modules = set(_modules())
    wrong = []
    for module, where in TESTED_ELSEWHERE.items():
        test_file, _, reason = where.partition(": ")
        if module not in modules:
            wrong.append(f"{module}: no such module any more; remove its entry")
        elif _mirror(module).is_file():
            wrong.append(f"{module}: has {_mirror(module).relative_to(ROOT)}; remove its entry")
        if not (ROOT / test_file).is_file() or not reason:
            wrong.append(f"{module}: name an existing test file and a reason, 'FILE: why'")
    assert not wrong, "\n".join(wrong)


def test_test_file_names_are_unique() -> None:
    """pytest imports a test file by its base name (no packages under tests/): two files of one
    name clash ("import file mismatch"), and spawned ranks unpickle a function from the wrong
    one."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(path.relative_to(ROOT).as_posix())
    clashes = [" and ".join(paths) for paths in seen.values() if len(paths) > 1]
    assert not clashes, "rename one of: " + "; ".join(clashes)
