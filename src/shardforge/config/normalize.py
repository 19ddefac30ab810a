"""Accept configs written for Axolotl and rewrite them into shardforge's spelling.

Axolotl users write ``fsdp: [full_shard, auto_wrap]`` plus an ``fsdp_config:`` block whose keys
carry an ``fsdp_`` prefix, and newer Axolotl puts ``fsdp_version`` at the top level. Each rewrite
is reported once as a notice; anything that has no meaning here is dropped with a notice naming it.
"""

from __future__ import annotations

from typing import Any

# Axolotl `fsdp:` list options -> (fsdp block key, value)
FSDP_LIST_OPTIONS: dict[str, tuple[str, Any] | None] = {
    "full_shard": ("reshard_after_forward", True),
    "shard_grad_op": ("reshard_after_forward", False),
    "hybrid_shard": None,
    "offload": ("offload_params", True),
    "auto_wrap": None,
}

# Keys of Axolotl's fsdp_config (after dropping the `fsdp_` prefix) that FSDP2 makes moot.
IGNORED_FSDP_KEYS = frozenset(
    {
        "auto_wrap_policy",
        "sync_module_states",
        "use_orig_params",
        "cpu_ram_efficient_loading",
        "backward_prefetch",
        "forward_prefetch",
        "sharding_strategy",
        "limit_all_gathers",
    }
)

# Renamed keys inside the fsdp block.
RENAMED_FSDP_KEYS = {
    "offload_params": "offload_params",
    "cpu_offload": "offload_params",
}


def _strip_prefix(key: str) -> str:
    return key[len("fsdp_") :] if key.startswith("fsdp_") and key != "fsdp_version" else key


def normalize_axolotl(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """Return (config in shardforge spelling, notices, problems). Pure: `raw` is not modified."""
    data = dict(raw)
    notices: list[str] = []
    problems: list[str] = []
    fsdp_value = data.get("fsdp")
    fsdp_config = data.pop("fsdp_config", None)
    top_version = data.pop("fsdp_version", None)

    if fsdp_config is None and top_version is None and not isinstance(fsdp_value, list | str):
        return data, notices, problems

    block: dict[str, Any] = {}
    if isinstance(fsdp_value, str):
        fsdp_value = fsdp_value.split()
    if isinstance(fsdp_value, list):
        for option in fsdp_value:
            mapped = FSDP_LIST_OPTIONS.get(str(option), "unknown")
            if mapped == "unknown":
                known = ", ".join(FSDP_LIST_OPTIONS)
                problems.append(f"fsdp: unknown option {option!r} (known: {known})")
            elif mapped is not None:
                block[mapped[0]] = mapped[1]
        notices.append(f"fsdp: {fsdp_value} (Axolotl list form) read as an fsdp block")
    elif isinstance(fsdp_value, dict):
        block.update(fsdp_value)

    if isinstance(fsdp_config, dict):
        dropped = []
        for key, value in fsdp_config.items():
            name = _strip_prefix(str(key))
            name = RENAMED_FSDP_KEYS.get(name, name)
            if name in IGNORED_FSDP_KEYS:
                dropped.append(str(key))
                continue
            block[name] = value
        notices.append("fsdp_config (Axolotl spelling) read as the fsdp block")
        if dropped:
            notices.append(f"fsdp_config keys ignored under FSDP2: {', '.join(sorted(dropped))}")
    elif fsdp_config is not None:
        problems.append(f"fsdp_config: expected a mapping, got {fsdp_config!r}")
    if top_version is not None:
        block.setdefault("fsdp_version", top_version)
    data["fsdp"] = block
    return data, notices, problems
