"""A real sidecar process for the memory benches, and its resident memory."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.multiprocess.harness import free_port

__all__ = ["metric_value", "rss_mib", "running_sidecar", "unix_socket_sidecar"]

REPO = Path(__file__).resolve().parents[1]


def rss_mib(pid: int) -> float:
    """The resident memory of process ``pid`` in MiB (VmRSS).

    Raises:
        RuntimeError: /proc shows no VmRSS for it.
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def metric_value(metrics_port: int, name: str) -> float:
    """The value of the unlabelled metric ``name`` on the sidecar's metrics
    port (loopback).

    Raises:
        LookupError: the page has no such sample.
    """
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
    raise LookupError(f"no sample {name!r} on the metrics page")


@contextmanager
def running_sidecar(
    metrics_port: int = 0, flags: tuple[str, ...] = ()
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``python -m moe_sidecar`` (with ``flags``) on a free loopback port with
    a state dir of its own (health off; metrics on ``metrics_port`` when it is
    not 0), once it accepts connections; yields the process and the port, and
    stops it on exit.

    Raises:
        AssertionError: it exited or did not listen within 30 s.
    """
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "moe_sidecar",
            "--listen", f"127.0.0.1:{port}",
            "--state-dir", f"{tmp}/state",
            "--health-port", "0", "--metrics-port", str(metrics_port), *flags,
        ]  # fmt: skip
        with open(f"{tmp}/sidecar.log", "wb") as log:
            process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline and process.poll() is None
                    time.sleep(0.1)  # the poll interval of a wait with a deadline
            yield process, port
        finally:
            process.terminate()
            process.wait(timeout=30)


@contextmanager
def unix_socket_sidecar(directory: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``moe-sidecar serve`` on the Unix socket ``directory/s.sock`` (its state
    and ``sidecar.log`` in ``directory``; health and metrics off), once the
    socket exists; yields the process and its target, and stops it (SIGTERM)
    on exit.

    Raises:
        SystemExit: it exited or made no socket within 60 s (its log says why).
    """
    socket_path = directory / "s.sock"
    target = f"unix://{socket_path}"
    command = [sys.executable, "-c", "import sys; from moe_sidecar.cli import main; "]
    command[-1] += "sys.exit(main(sys.argv[1:]))"
    command += ["serve", "--listen", target, "--state-dir", str(directory / "state")]
    command += ["--health-port", "0", "--metrics-port", "0", "--log-format", "text"]
    with open(directory / "sidecar.log", "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not socket_path.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"the sidecar did not start: {(directory / 'sidecar.log').read_text()}"
                )
            time.sleep(0.05)  # the poll interval of a wait with a deadline
        yield process, target
    finally:
        process.terminate()
        process.wait(timeout=30)
