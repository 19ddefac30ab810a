from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from shardforge.cli.config_schema import command


def test_prints_valid_json_schema() -> None:
    result = CliRunner().invoke(command, [])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["title"] == "ShardforgeConfig"
    assert "base_model" in schema["properties"]
    assert schema["properties"]["base_model"]["description"]


def test_fire_module_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardforge.cli.config_schema"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["required"] == ["base_model"]
