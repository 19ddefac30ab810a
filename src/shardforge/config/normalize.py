"""Accept configs written for Axolotl and rewrite them into shardforge's spelling.

Axolotl users write ``fsdp: [full_shard, auto_wrap]`` plus an ``fsdp_config:`` block whose keys
carry an ``fsdp_`` prefix, and newer Axolotl puts ``fsdp_version`` at the top level. Each rewrite
is reported once as a notice; anything that has no meaning here is dropped with a notice naming it.
"""

from __future__ import annotations

from typing import Any

from shardforge.config.axolotl_status import FSDP_CONFIG_KEYS


class Notice(str):
    """A notice line; `how_read` for one that only says how a key was read (an Axolotl
    spelling, a key FSDP2 makes moot, the keys a command leaves unread): what a normal config
    does, so shown by `validate` and --debug rather than on every command."""

    how_read: bool = False


def how_read(text: str) -> Notice:
    notice = Notice(text)
    notice.how_read = True
    return notice


# FSDP1 `sharding_strategy` (fsdp_config) -> FSDP2 settings. FSDP2 has no NO_SHARD.
SHARDING_STRATEGIES: dict[str, dict[str, Any]] = {
    "FULL_SHARD": {"reshard_after_forward": True},
    "SHARD_GRAD_OP": {"reshard_after_forward": False},
    "HYBRID_SHARD": {"hybrid_shard": True, "reshard_after_forward": True},
    "HYBRID_SHARD_ZERO2": {"hybrid_shard": True, "reshard_after_forward": False},
    "_HYBRID_SHARD_ZERO2": {"hybrid_shard": True, "reshard_after_forward": False},
}
# Axolotl `fsdp:` list options -> fsdp block settings: the strategies in lower case, plus
# offload and auto_wrap (nothing to set under FSDP2)
FSDP_LIST_OPTIONS: dict[str, dict[str, Any]] = {
    **{name.lower(): settings for name, settings in SHARDING_STRATEGIES.items()},
    "offload": {"offload_params": True},
    "auto_wrap": {},
}
# torch's ShardingStrategy enum numbers, which some configs carry instead of the name
_STRATEGY_NUMBERS = {
    1: "FULL_SHARD",
    2: "SHARD_GRAD_OP",
    4: "HYBRID_SHARD",
    5: "_HYBRID_SHARD_ZERO2",
}

# Keys of Axolotl's fsdp_config (after dropping the `fsdp_` prefix) that FSDP2 makes moot.
IGNORED_FSDP_KEYS = frozenset(k for k, row in FSDP_CONFIG_KEYS.items() if row.status == "ignored")

# Renamed keys inside the fsdp block.
RENAMED_FSDP_KEYS = {
    "offload_params": "offload_params",
    "cpu_offload": "offload_params",
}


def _sharding_strategy(value: Any) -> tuple[dict[str, Any] | None, str]:
    """(FSDP2 settings, problem) of an FSDP1 sharding strategy name or number."""
    name = str(_STRATEGY_NUMBERS.get(value, value) if isinstance(value, int) else value)
    name = name.strip().upper().removeprefix("SHARDINGSTRATEGY.")
    if name in SHARDING_STRATEGIES:
        return SHARDING_STRATEGIES[name], ""
    if name == "NO_SHARD":
        return None, (
            "fsdp_config.fsdp_sharding_strategy: NO_SHARD (pure data parallel) has no FSDP2 "
            "equivalent in shardforge; use FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD"
        )
    known = ", ".join(s for s in SHARDING_STRATEGIES if not s.startswith("_"))
    return None, f"fsdp_config.fsdp_sharding_strategy: unknown strategy {value!r} (known: {known})"


def _strip_prefix(key: str) -> str:
    return key[len("fsdp_") :] if key.startswith("fsdp_") and key != "fsdp_version" else key


def normalize_axolotl(raw: dict[str, Any]) -> tuple[dict[str, Any], list[Notice], list[str]]:
    """Return (config in shardforge spelling, notices, problems). Pure: `raw` is not modified."""
    data = dict(raw)
    notices: list[Notice] = []
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
            mapped = FSDP_LIST_OPTIONS.get(str(option).strip().lower())
            if mapped is None:
                known = ", ".join(o for o in FSDP_LIST_OPTIONS if not o.startswith("_"))
                problems.append(f"fsdp: unknown option {option!r} (known: {known})")
            else:
                block.update(mapped)
        notices.append(how_read(f"fsdp: {fsdp_value} (Axolotl list form) read as an fsdp block"))
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
            if name == "sharding_strategy":
                settings, problem = _sharding_strategy(value)
                if problem:
                    problems.append(problem)
                else:
                    block.update(settings or {})
                    notices.append(how_read(f"{key}: {value} read as {settings}"))
                continue
            block[name] = value
        notices.append(how_read("fsdp_config (Axolotl spelling) read as the fsdp block"))
        if dropped:
            moot = f"fsdp_config keys ignored under FSDP2: {', '.join(sorted(dropped))}"
            notices.append(how_read(moot))
    elif fsdp_config is not None:
        problems.append(f"fsdp_config: expected a mapping, got {fsdp_config!r}")
    if top_version is not None:
        block.setdefault("fsdp_version", top_version)
    data["fsdp"] = block
    return data, notices, problems
