"""``moe-sidecar doctor`` against real sidecars, a real etcd and real state dirs:
one line per check, exit status 0 only when every check holds, ``--json``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_sidecar.server import running_server
from tests.etcd_server import EtcdServer
from tests.integration.helpers import ROOT, make_config

pytestmark = pytest.mark.timeout(60)

_MAIN = "import sys; from moe_sidecar.cli import main; sys.exit(main())"
CHECKS = ["config", "answers", "serving", "state dir", "store"]


async def _doctor(
    *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _MAIN, "doctor", "--timeout", "5", *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
        env={**environ, **(env or {})},
    )  # fmt: skip


def _lines(done: subprocess.CompletedProcess[str]) -> list[tuple[str, str, str]]:
    """(ok or FAIL, check, detail) of each line."""
    rows = []
    for line in done.stdout.splitlines():
        verdict, _, rest = line.partition("  ")
        name, _, detail = rest.strip().partition(": ")
        rows.append((verdict.strip(), name, detail))
    return rows


async def test_a_serving_sidecar_passes_with_no_flags_from_its_environment(tmp_path: Path) -> None:
    # As in the image: serve's own variables name the socket and the state dir.
    config = make_config(tmp_path)
    async with running_server(config):
        done = await _doctor(
            env={
                "MOE_SIDECAR_LISTEN": ",".join(config.listen),
                "MOE_SIDECAR_STATE_DIR": str(config.state_dir),
            }
        )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _lines(done)
    assert [(v, n) for v, n, _ in rows] == [("ok", n) for n in CHECKS], done.stdout
    details = {n: d for _, n, d in rows}
    assert details["answers"].startswith(f"{config.listen[0]} answered ListGroups in ")
    assert details["serving"].endswith(": SERVING")
    assert details["state dir"] == f"{config.state_dir}: writable by uid {os.getuid()}"
    assert details["store"].startswith(f"SQLite {config.state_dir}/sidecar.sqlite3: readable")


async def test_json_says_which_checks_fail(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with running_server(config) as server:
        health = f"127.0.0.1:{server.addresses.health_port}"
        done = await _doctor("--target", health, "--state-dir", str(config.state_dir), "--json")
    assert done.returncode == 1, done.stderr
    answer = json.loads(done.stdout)
    assert answer["ok"] is False and answer["target"] == health
    verdicts = {c["name"]: c["ok"] for c in answer["checks"]}
    assert verdicts == {"config": True, "answers": False, "serving": True, "state dir": True,
                        "store": True}  # fmt: skip
    answers = next(c for c in answer["checks"] if c["name"] == "answers")
    assert "this is the sidecar's health port (--health-port)" in answers["detail"]


async def test_no_sidecar_and_an_unusable_state_dir_fail(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    done = await _doctor("--target", f"unix://{tmp_path}/nobody.sock", "--state-dir", str(blocked))
    assert done.returncode == 1
    rows = _lines(done)
    assert [(v, n) for v, n, _ in rows] == [
        ("ok", "config"),
        ("FAIL", "answers"),
        ("FAIL", "serving"),
        ("FAIL", "state dir"),
        ("FAIL", "store"),
    ], done.stdout
    assert "UNAVAILABLE" in rows[1][2]
    assert rows[3][2] == f"{blocked}: no such directory (serve creates it)"


async def test_a_refused_configuration_is_a_failed_check(tmp_path: Path) -> None:
    done = await _doctor("--target", f"unix://{tmp_path}/nobody.sock", "--state-dir", "")
    assert done.returncode == 1
    rows = _lines(done)
    assert rows[0] == ("FAIL", "config", "--state-dir '': must name a path; empty would mean "
                       "the working directory")  # fmt: skip
    assert rows[-1] == ("FAIL", "store", "not checked: the configuration is refused (above)")


@pytest.mark.etcd
async def test_with_etcd_the_cluster_store_is_checked(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    config = make_config(tmp_path, store=etcd_server.url)
    async with running_server(config):
        up = await _doctor(
            "--target", config.listen[0], "--state-dir", str(config.state_dir),
            "--store", etcd_server.url,
        )  # fmt: skip
        etcd_server.pause()
        try:
            down = await _doctor(
                "--target", config.listen[0], "--state-dir", str(config.state_dir),
                "--store", etcd_server.url, "--timeout", "1",
            )  # fmt: skip
        finally:
            etcd_server.resume()
    assert up.returncode == 0, up.stdout + up.stderr
    assert _lines(up)[-1] == ("ok", "cluster store",
                              f"etcd {etcd_server.endpoint} (prefix /test/): answered")  # fmt: skip
    assert down.returncode == 1, down.stdout
    assert _lines(down)[-1][:2] == ("FAIL", "cluster store")
