"""The client's rejoin refuses what it cannot do, naming why, before any
collective or RPC: another peer-loss policy, embedded mode; and it makes
every built-in backend again on the re-formed group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from moe_sidecar.client import rejoin
from moe_sidecar.client.backends import BACKENDS
from moe_sidecar.client.errors import PreconditionFailed
from moe_sidecar.client.layer_need import LayerNeed, Layout
from moe_sidecar.client.manager import AlltoAllManager
from moe_sidecar.client.rejoin import join_as_replacement
from moe_sidecar.client.sizing import layer_capacities

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cpu_group(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    """A one-rank gloo group on a rendezvous file in ``tmp_path``."""
    init_method = f"file://{tmp_path / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def _need() -> LayerNeed:
    capacities = layer_capacities(1, 4, 2, 8, 16, 32, 0)
    return LayerNeed(capacities, Layout(16, None, None, 32, 0), "model.layers.0.mlp")


@pytest.mark.parametrize(
    ("policy", "why"),
    [("exit", "the policy is 'exit'"), ("mask", "the policy is 'mask', embedded mode")],
)
def test_rejoin_and_join_are_refused_without_a_sidecar_masking(
    cpu_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch, policy: str, why: str
) -> None:
    monkeypatch.setenv("MOE_SIDECAR_ON_PEER_LOSS", policy)
    manager = AlltoAllManager(cpu_group, group="g", target="embedded", backend="reference")
    with pytest.raises(
        PreconditionFailed, match=r"rejoin\(\) needs MOE_SIDECAR_ON_PEER_LOSS=mask"
    ) as info:
        manager.rejoin(cpu_group)
    assert why in str(info.value)
    with pytest.raises(PreconditionFailed, match=r"join_as_replacement\(\) needs") as info:
        join_as_replacement(manager, _need())
    assert why in str(info.value)
    assert manager.plan is None and manager.counters.collectives == 0  # nothing happened


@pytest.mark.parametrize("name", ["flashinfer-moe-alltoall", "flashinfer-moe-ep", "reference"])
def test_every_built_in_backend_is_made_again_on_the_new_group(
    cpu_group: dist.ProcessGroup, name: str
) -> None:
    # Made, never built: no FlashInfer module is loaded on this CPU path.
    manager = AlltoAllManager(cpu_group, group="g", target="embedded", backend=name)
    old = manager.backend
    assert old.name in BACKENDS  # 0.7.2.post1's backend calls itself "flashinfer"
    new_group = dist.new_group(backend="gloo")
    rejoin._rebind(manager, new_group)
    assert manager.backend is not old and type(manager.backend) is type(old)
    assert manager._held.backend is manager.backend
    assert manager.cpu_group is new_group and manager._on_group._cpu_group is new_group
