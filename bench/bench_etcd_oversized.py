"""Peak memory of a sidecar starting on an etcd prefix full of oversized
documents, against one starting on an empty prefix, in the same run.

    .venv/bin/python -m bench.bench_etcd_oversized [--documents N] [--bytes B]

Starts a real etcd (Debian's etcd-server, as the tests do: tests/etcd_server.py)
and writes N junk documents of B bytes (default 200 of 1.4 MB, each over the
default ``--store-max-document-bytes`` of 1 MiB) under one prefix. Then starts
a real sidecar process on an empty prefix (the baseline) and one on the full
prefix, each until it serves and (the second) has set every document aside,
and prints each one's peak RSS (VmHWM) and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.etcd_server import EtcdServer, EtcdTestClient, etcd_binary, free_port

REPO = Path(__file__).resolve().parents[1]
REJECTED = "moe_sidecar_store_rejected_documents_total"


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def sidecar_peak_rss_mib(workdir: Path, url: str, rejected: int) -> float:
    """Starts a sidecar on ``url``; waits until it has set ``rejected``
    documents aside and serves; returns its peak RSS in MiB."""
    workdir.mkdir(parents=True)
    port = free_port()
    command = [
        sys.executable, "-m", "moe_sidecar",
        "--listen", f"unix://{workdir}/s.sock",
        "--state-dir", str(workdir / "state"),
        "--health-port", "0", "--metrics-port", str(port),
        "--store", url,
    ]  # fmt: skip
    with open(workdir / "sidecar.log", "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (workdir / "sidecar.log").read_text()
            assert time.monotonic() < deadline, "the sidecar did not read the prefix in time"
            try:
                if (workdir / "s.sock").exists() and _metric(port, REJECTED) >= rejected:
                    break
            except OSError:
                pass  # the metrics port is not up yet
            time.sleep(0.1)  # the poll interval of a wait with a deadline
        return _peak_rss_mib(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=30)


async def fill_prefix(endpoint: str, prefix: str, documents: int, size: int) -> None:
    async with EtcdTestClient([endpoint]) as client:
        for n in range(documents):
            await client.put(f"{prefix}/groups/junk-{n:04d}", bytes([n % 251]) * size)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--bytes", type=int, default=1_400_000)
    args = parser.parse_args()
    binary = etcd_binary()
    if binary is None:
        print("etcd not found (apt-get install etcd-server)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        etcd = EtcdServer(
            work / "etcd", binary=binary, extra_args=("--quota-backend-bytes=4294967296",)
        )
        (work / "etcd").mkdir()
        etcd.start()
        try:
            asyncio.run(fill_prefix(etcd.endpoint, "/big", args.documents, args.bytes))
            base = sidecar_peak_rss_mib(work / "empty", f"etcd://{etcd.endpoint}/empty", 0)
            full = sidecar_peak_rss_mib(
                work / "full", f"etcd://{etcd.endpoint}/big", args.documents
            )
        finally:
            etcd.stop()
    print(time.strftime("bench_etcd_oversized, %Y-%m-%d %H:%M UTC", time.gmtime()))
    print(f"{args.documents} documents of {args.bytes:,} B under the prefix")
    print(f"peak RSS, empty prefix (baseline): {base:7.1f} MiB")
    print(f"peak RSS, oversized documents:     {full:7.1f} MiB  ({full / base:.2f}x the baseline)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
