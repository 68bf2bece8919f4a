"""A client or ``moe-sidecar groups`` pointed at the health port is told so
instead of gRPC's bare ``UNIMPLEMENTED: Method not found!``, and a rank's
peer-loss watcher does not wait for a Watch stream there first."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_sidecar.client.errors import InternalError
from moe_sidecar.client.peer_loss import SUBSCRIBE_WAIT_S, PeerLossPolicy, PeerLossWatch
from moe_sidecar.client.transport import GrpcTransport
from moe_sidecar.core.group import Proposal, Requirement
from moe_sidecar.core.plan import Capacities
from moe_sidecar.server import running_server
from tests.integration.helpers import ROOT, make_config

pytestmark = pytest.mark.timeout(60)

_MAIN = "import sys; from moe_sidecar.cli import main; sys.exit(main())"


def _propose(target: str) -> None:
    transport = GrpcTransport(target, unavailable_retry=0.0)
    try:
        transport.propose(
            Proposal(
                group="g",
                ep_size=1,
                ep_rank=0,
                local_ranks=1,
                lifetime="life-1-lifetime-token",
                round=1,
                requirement=Requirement(Capacities(16, 64, 128, 2, 8), "layer.0"),
            )
        )
    finally:
        transport.close()


async def test_a_client_pointed_at_the_health_port_is_told_so(tmp_path: Path) -> None:
    async with running_server(make_config(tmp_path)) as server:
        target = f"127.0.0.1:{server.addresses.health_port}"
        with pytest.raises(InternalError) as info:
            await asyncio.to_thread(_propose, target)
    message = info.value.message
    assert message.startswith(f"Propose to sidecar {target}: UNIMPLEMENTED (Method not found!): ")
    assert f"{target} is the sidecar's health port (--health-port" in message
    assert "MOE_SIDECAR_TARGET" in message


async def test_groups_pointed_at_the_health_port_is_told_so(tmp_path: Path) -> None:
    async with running_server(make_config(tmp_path)) as server:
        target = f"127.0.0.1:{server.addresses.health_port}"
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", _MAIN, "groups", "--target", target],
            cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
            env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
        )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr == (
        f"moe-sidecar groups: {target}: UNIMPLEMENTED (Method not found!): this is the sidecar's "
        "health port (--health-port), which serves only health checks; give --target an address "
        "the sidecar's --listen serves (default 127.0.0.1:50051)\n"
    )


async def test_a_peer_loss_watcher_pointed_at_the_health_port_does_not_wait_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The health port answers Watch UNIMPLEMENTED: no stream will ever be
    # subscribed, so the rank's first call goes on at once to the propose that
    # says which port this is, with no "could not subscribe" warning before it.
    async with running_server(make_config(tmp_path)) as server:
        target = f"127.0.0.1:{server.addresses.health_port}"
        watch = PeerLossWatch(target, PeerLossPolicy.RAISE)
        started = time.monotonic()
        try:
            await asyncio.to_thread(watch.check, "g/ep2", 0, "life-1-lifetime-token", ep_size=2)
        finally:
            watch.stop()
        waited = time.monotonic() - started
    assert waited < SUBSCRIBE_WAIT_S / 2, waited
    assert "could not subscribe" not in caplog.text, caplog.text
