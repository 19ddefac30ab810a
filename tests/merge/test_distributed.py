"""The distributed merge (`--nproc_per_node N`, gloo CPU ranks): byte-identical to the
single-process merge for every layout at 2 ranks, and for ours at 3 ranks too (an uneven split:
large tensors cut across ranks where 3 does not divide their rows); a rank killed mid-merge
leaves nothing at the output path and the input unchanged.
(Where 2 and 3 ranks cut each tensor is checked for 1 to 5 ranks without processes, in
`test_shares_cover_every_byte_once_and_split_large_tensors`; a torchrun launch costs seconds.)

Every layout and the torchtitan step are merged on 2 gloo ranks in one launch, and ours on 3
in another, each with `group=` (the same `merge_on_ranks` that `merge_rank` runs: the launcher
does not depend on the layout, and each torchrun launch costs processes that import torch; the
ranks start with torch imported: `run_on_preloaded_ranks`). Ours is also merged through the real
CLI and torchrun (`merge_rank` on each rank) at 2 ranks, and the tests of signals and kills
below launch 2 ranks through them.

The checkpoints are the session-shared ones of `test_inspection` (3 gloo ranks of a tiny Llama
in our, HF Trainer, Lightning, verl and LMMs-Engine layouts), plus a torchtitan step (its own
names, RoPE-permuted q/k) written as `test_merge_sources` writes it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from helpers.gate import Gate
from helpers.preloaded import run_on_preloaded_ranks
from helpers.procs import still_running
from shardforge.cli.main import cli
from shardforge.merge.distributed import shares
from test_inspection import Built, build_checkpoints

# the checkpoints are written by gloo ranks; the merges run under torchrun
pytestmark = pytest.mark.slow

LAYOUTS = {  # layout -> its tree in test_inspection's checkpoints
    "ours": "ours",
    "hf-trainer": "hf",
    "lightning": "lightning",
    "verl": "verl",
    "lmms-engine": "lmms",
}
# the world sizes each layout's merge runs at with group= (3: the uneven split, once), a launch
# per world size for every layout; ours also through the CLI and torchrun at 2 ranks
WORLDS = {layout: (2, 3) if layout == "ours" else (2,) for layout in LAYOUTS}
TORCHRUN_WORLDS = (2,)
TITAN = "torchtitan"
OK = "ok"
# the outputs' folder (a folder per world size), name -> (base model, checkpoint), name -> the
# checkpoint's tree before
OnRanks = tuple[Path, dict[str, tuple[Path, Path]], dict[str, dict[str, str]]]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base model, torchtitan checkpoint root): test_merge_sources's, shared."""
    from test_merge_sources import build_sources

    sources = build_sources(tmp_path_factory)
    return sources.base, sources.root / "titan"


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _merge(base: Path, checkpoint: Path, out: Path, *extra: str) -> None:
    cfg = out.parent / f"{out.name}.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(base), "output_dir": "unused"}))
    args = [str(cfg), "--output_path", str(out), "--checkpoint", str(checkpoint), "--quiet"]
    result = CliRunner().invoke(cli, ["merge-sharded-fsdp-weights", *args, *extra])
    assert result.exit_code == 0, result.output


def _same_bytes_on_ranks(
    base: Path, checkpoint: Path, tmp_path: Path, worlds: tuple[int, ...]
) -> None:
    before = _tree(checkpoint)
    _merge(base, checkpoint, tmp_path / "one")
    want = _tree(tmp_path / "one")
    for n in worlds:
        out = tmp_path / f"ranks{n}"
        _merge(base, checkpoint, out, "--nproc_per_node", str(n), "--verify")
        assert _tree(out) == want, (checkpoint, n)
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".ranks{n}")]
    assert _tree(checkpoint) == before


def _merge_each(rank: int, world: int, jobs: dict[str, tuple[str, str]], out: str) -> None:
    """On each rank: every job (base model, checkpoint) merged with --verify on the ranks
    (`group=`), its outcome in a file (a failing job must not hide the others')."""
    import torch.distributed as dist

    from shardforge.merge.api import merge_fsdp_weights

    for name, (base, checkpoint) in jobs.items():
        cfg = {"base_model": base, "output_dir": "unused"}
        try:
            merge_fsdp_weights(
                cfg, Path(out) / name, checkpoint=checkpoint, verify=True, quiet=True,
                group=dist.group.WORLD,
            )  # fmt: skip
            outcome = OK
        except Exception:
            outcome = traceback.format_exc()
        (Path(out) / f"{name}.{rank}.result").write_text(outcome)


@pytest.fixture(scope="module")
def on_ranks(
    built: Built, titan: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> OnRanks:
    """Every layout, and the torchtitan step, merged on gloo ranks with --verify, a launch
    per world size (`WORLDS`; the torchtitan step on 2): (the outputs' folder, name ->
    (base, checkpoint), name -> the checkpoint's tree before)."""
    jobs = {layout: (built.base, built.root / tree) for layout, tree in LAYOUTS.items()}
    jobs[TITAN] = titan
    before = {name: _tree(checkpoint) for name, (_, checkpoint) in jobs.items()}
    out = tmp_path_factory.mktemp("on-ranks")
    worlds = {**WORLDS, TITAN: (2,)}
    for world in sorted({n for ns in worlds.values() for n in ns}):
        mine = {k: (str(b), str(c)) for k, (b, c) in jobs.items() if world in worlds[k]}
        (out / str(world)).mkdir()
        # the ranks start with torch and transformers imported (a fork server's)
        run_on_preloaded_ranks(_merge_each, world, mine, str(out / str(world)))
    return out, jobs, before


def _same_bytes_on_gloo_ranks(
    on_ranks: OnRanks, name: str, tmp_path: Path, worlds: tuple[int, ...]
) -> None:
    out, jobs, before = on_ranks
    base, checkpoint = jobs[name]
    _merge(base, checkpoint, tmp_path / "one")
    for n in worlds:
        for rank in range(n):
            assert (out / str(n) / f"{name}.{rank}.result").read_text() == OK
        assert _tree(out / str(n) / name) == _tree(tmp_path / "one"), (checkpoint, n)
        assert not [p for p in (out / str(n)).iterdir() if p.name.startswith(f".{name}")]
    assert _tree(checkpoint) == before[name]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_ranks_write_the_single_process_bytes(
    built: Built, on_ranks: OnRanks, tmp_path: Path, layout: str
) -> None:
    _same_bytes_on_gloo_ranks(on_ranks, layout, tmp_path, WORLDS[layout])
    if layout == "ours":  # also through the CLI and torchrun
        (tmp_path / "cli").mkdir()
        _same_bytes_on_ranks(built.base, built.ours, tmp_path / "cli", TORCHRUN_WORLDS)


def test_a_torchtitan_step_on_two_ranks(on_ranks: OnRanks, tmp_path: Path) -> None:
    """Its own names and RoPE-permuted q/k, on 2 ranks (3 ranks: `ours` above)."""
    _same_bytes_on_gloo_ranks(on_ranks, TITAN, tmp_path, (2,))


def test_shares_cover_every_byte_once_and_split_large_tensors(built: Built, tmp_path: Path) -> None:
    """The plan's row ranges over 1 to 5 ranks: disjoint and covering every tensor, with
    tensors split by rows where a rank's byte span ends inside them."""
    from shardforge.config import load_cfg
    from shardforge.merge.prepare import prepare as _prepare
    from shardforge.merge.request import MergeRequest

    cfg_path = tmp_path / "cfg.yml"
    cfg_path.write_text(yaml.safe_dump({"base_model": str(built.base), "output_dir": "x"}))
    request = MergeRequest(tmp_path / "o", checkpoint=built.ours)
    plan = _prepare(load_cfg(cfg_path, command="merge").to_model(), request).plan
    largest = max((t for _, t in plan.tensors()), key=lambda t: t.spec.nbytes).spec.name
    for world in range(1, 6):
        rows: dict[str, list[tuple[int, int]]] = {}
        owners: dict[str, set[int]] = {}
        for rank in range(world):
            for s in shares(plan, rank, world):
                rows.setdefault(s.tensor.spec.name, []).append(s.rows)
                owners.setdefault(s.tensor.spec.name, set()).add(rank)
        for _, t in plan.tensors():
            got = sorted(rows[t.spec.name])
            n = t.spec.shape[0] if t.spec.shape else 1
            assert got[0][0] == 0 and got[-1][1] == n, t.spec.name
            assert all(a[1] == b[0] for a, b in itertools.pairwise(got)), t.spec.name
        if world >= 2:  # span boundaries fall inside tensors: those are split by rows
            assert any(len(o) > 1 for o in owners.values()), world
    assert largest in rows


def test_a_rank_killed_mid_merge_leaves_nothing(built: Built, tmp_path: Path) -> None:
    """SIGKILL of rank 1 once rank 0 has created the hidden output directory: torchrun stops
    the job, the command fails, nothing is at the output path and the checkpoint is unchanged.
    Rank 0 pauses right after creating that directory (a test gate on `os.mkdir`), so the kill
    always lands mid-merge, however quick the tiny merge is."""
    before = _tree(built.ours)
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(built.base), "output_dir": "unused"}))
    out = tmp_path / "out"
    gate = Gate(tmp_path / "gate", "os:mkdir", r"/\.out\.tmp-[^/]+$")
    cmd = [sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(cfg),
           "--output_path", str(out), "--checkpoint", str(built.ours), "--nproc_per_node", "2",
           "--verify"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=gate.env())
    try:
        (paused,) = gate.wait(proc)
        victim = _rank_pid(proc.pid, rank=1)
        assert victim is not None and _rank_pid(proc.pid, rank=0) == paused
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        gate.open()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, err
    assert not out.exists(), err
    assert _tree(built.ours) == before


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the torchrun worker with RANK=`rank` below `launcher`."""
    import psutil

    for child in psutil.Process(launcher).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "merge_rank" in " ".join(
                child.cmdline()
            ):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def test_kill_9_of_the_commands_process_group_ends_every_rank(built: Built, tmp_path: Path) -> None:
    """A 2-rank merge frozen while it writes (rank 0 holds the output's lock and has created
    its hidden directory): a second merge to that output is refused, naming rank 0; `kill -9`
    of the command's process group (as a terminal or a job scheduler ends a job) then ends
    torchrun's agent and both ranks, although torchrun starts them in sessions of their own,
    and nothing is published once the gate opens. The lock rank 0 left is then taken over by
    the next merge, with a notice."""
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(built.base), "output_dir": "unused"}))
    out = tmp_path / "out"
    gate = Gate(tmp_path / "gate", "os:mkdir", r"/\.out\.tmp-[^/]+$")
    cmd = [sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(cfg),
           "--output_path", str(out), "--checkpoint", str(built.ours), "--nproc_per_node", "2",
           "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=gate.env(), start_new_session=True)
    try:
        (paused,) = gate.wait(proc)
        ranks = [_rank_pid(proc.pid, rank=r) for r in (0, 1)]
        assert ranks[0] == paused and ranks[1] is not None
        import psutil

        family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        (agent,) = psutil.Process(proc.pid).children()
        args = [str(cfg), "--output_path", str(out), "--checkpoint", str(built.ours)]
        second = CliRunner().invoke(cli, ["merge-sharded-fsdp-weights", *args])
        assert second.exit_code != 0, second.output
        assert f"in use by shardforge merge-sharded-fsdp-weights (rank 0 of 2) (pid {paused} " in (
            second.output
        ), second.output
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # once the agent has ended, its end has sent SIGKILL to the ranks: they run no more
        # code (the few milliseconds a process takes to die are not what is tested here)
        still_running([agent.pid], seconds=10)
    finally:
        gate.open()  # a rank that outlived the kill goes on (and would publish)
        if proc.poll() is None:
            proc.kill()
    assert not still_running(family, seconds=10), "processes of the merge outlived the kill"
    assert not out.exists()
    assert json.loads((tmp_path / "out.shardforge.lock").read_text())["pid"] == paused

    third = CliRunner().invoke(cli, ["merge-sharded-fsdp-weights", *args, "--quiet"])
    assert third.exit_code == 0, third.output
    assert "taking over the lock of a writer that has ended" in third.output, third.output
    assert (out / "model.safetensors").is_file() and not (tmp_path / "out.shardforge.lock").exists()


def test_sigterm_to_the_commands_own_process_leaves_nothing_beside_the_output(
    built: Built, tmp_path: Path
) -> None:
    """SIGTERM to the command's own process only (what `timeout`, `kill PID` and a container
    stop send), while rank 0 holds the output's lock and creates its hidden directory: the
    command stops as interrupted, and nothing is left beside the output - no hidden directory,
    no lock file, no rank, no launcher's request folder. (SIGINT, Ctrl-C to that process, stops
    the ranks the same way: the launcher asks torchrun to stop them with SIGTERM.)"""
    signum = signal.SIGTERM
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(built.base), "output_dir": "unused"}))
    out = tmp_path / "out"
    gate = Gate(tmp_path / "gate", "os:mkdir", r"/\.out\.tmp-[^/]+$")
    cmd = [sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(cfg),
           "--output_path", str(out), "--checkpoint", str(built.ours), "--nproc_per_node", "2",
           "--quiet"]  # fmt: skip
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = subprocess.Popen(
        cmd, env={**gate.env(), "TMPDIR": str(temp)}, stderr=subprocess.PIPE, text=True
    )
    try:
        (paused,) = gate.wait(proc)
        import psutil

        family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert paused in family
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        gate.open()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "error: interrupted" in err, err
    assert "Traceback" not in err, err
    assert not still_running(family, seconds=10), "processes of the merge outlived it"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yml", "gate", "temp"], err
    # (a rank killed after torchrun's wait instead of stopping would have left its directory)
    assert not list(temp.glob("shardforge-*"))  # the launcher's request folder
