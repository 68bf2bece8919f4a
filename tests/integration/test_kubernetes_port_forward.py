"""docs/kubernetes.md's port-forward lines ("Looking into a running pod"),
run as written: the port-forward maps the image's own three ports one to
one, and every line after it runs in a shell (the real grpcurl of the dev
extra, the machine's curl and grep) against a real sidecar, with the
forwarded addresses replaced by the test server's listener, health port
and metrics port. Each line must exit 0 and print what it stands for."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from moe_sidecar.server import RunningServer, running_server
from tests.dockerfile import REPO, parse_dockerfile
from tests.integration.helpers import coordinator_stub, make_config, run_round
from tests.integration.test_readme_grpcurl import COMMAND_TIMEOUT, grpcurl_binary
from tests.integration.test_reflection_only import LAYER, SEEDED_RANKS

pytestmark = pytest.mark.timeout(90)

PAGE = REPO / "docs" / "kubernetes.md"
SECTION = "Looking into a running pod"


def _lines() -> tuple[list[str], list[str]]:
    """The port-forward's words, and the lines after it (continuations joined)."""
    text = PAGE.read_text()
    start = text.index(SECTION)
    found = re.search(r"```bash\n(.*?)```", text[start:], re.DOTALL)
    assert found, f"no bash block after {SECTION!r} in {PAGE}"
    lines = [line.strip() for line in found.group(1).replace("\\\n", " ").splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    [at] = [i for i, line in enumerate(lines) if line.startswith("kubectl port-forward ")]
    return shlex.split(lines[at], comments=True), lines[at + 1 :]


def _image_ports() -> dict[str, int]:
    """The sidecar image's TCP listener, health and metrics ports."""
    env = parse_dockerfile()[-1].env({})
    [tcp] = [a for a in env["MOE_SIDECAR_LISTEN"].split(",") if not a.startswith("unix://")]
    return {
        "listen": int(tcp.rpartition(":")[2]),
        "health": int(env["MOE_SIDECAR_HEALTH_PORT"]),
        "metrics": int(env["MOE_SIDECAR_METRICS_PORT"]),
    }


def test_the_port_forward_maps_the_images_three_ports_one_to_one() -> None:
    forward, after = _lines()
    assert forward[:3] == ["kubectl", "port-forward", "$POD"], forward
    pairs = [tuple(int(p) for p in mapping.split(":")) for mapping in forward[3:]]
    assert all(local == remote for local, remote in pairs), pairs
    assert sorted(local for local, _ in pairs) == sorted(_image_ports().values())
    # What comes after it uses the forwarded ports, and each of them.
    used = {int(port) for line in after for port in re.findall(r"127\.0\.0\.1:(\d+)", line)}
    assert used == set(_image_ports().values()), after
    assert [line.split()[0] for line in after] == ["grpcurl", "grpcurl", "grpcurl", "curl"]


def _as_run_here(line: str, server: RunningServer) -> str:
    ports = _image_ports()
    here = {
        ports["listen"]: server.addresses.listen[1],
        ports["health"]: f"127.0.0.1:{server.addresses.health_port}",
        ports["metrics"]: f"127.0.0.1:{server.addresses.metrics_port}",
    }
    return re.sub(r"127\.0\.0\.1:(\d+)", lambda m: here[int(m.group(1))], line)


async def _shell(line: str, path: str) -> tuple[int | None, str, str]:
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-o",
        "pipefail",
        "-c",
        line,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(os.environ, PATH=path),
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), COMMAND_TIMEOUT)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return process.returncode, out.decode(), err.decode()


async def test_every_line_after_the_port_forward_works_against_a_real_sidecar(
    tmp_path: Path,
) -> None:
    grpcurl = grpcurl_binary()
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    _, after = _lines()
    [group] = {json.loads(m)["group"] for m in re.findall(r"-d '(\{.*?\})'", " ".join(after))}
    path = f"{grpcurl.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    config = make_config(tmp_path, metrics_port=0)
    async with running_server(config) as server:
        async with coordinator_stub(server.addresses.listen[1]) as stub:
            await run_round(stub, 1, LAYER, group=group, local_ranks=SEEDED_RANKS)
        ran = [(line, await _shell(_as_run_here(line, server), path)) for line in after]
    for line, (status, out, err) in ran:
        assert status == 0, f"{line}\nexit {status}\n{out}\n{err}"
        if "ListGroups" in line:
            assert [g["name"] for g in json.loads(out)["groups"]] == [group], out
        elif "GetGroup" in line:
            assert json.loads(out)["name"] == group, out
        elif "Health/Check" in line:
            assert json.loads(out) == {"status": "SERVING"}, out
        else:
            metrics = out.splitlines()
            assert metrics and all(m.startswith("moe_sidecar_") for m in metrics), out
            assert any(m.startswith("moe_sidecar_groups") for m in metrics), out
