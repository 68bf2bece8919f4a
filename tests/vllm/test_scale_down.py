"""vLLM 0.34's own ``scale_down`` recovering through moe-sidecar's masked path.

Real processes: a ``python -m moe_sidecar`` process, four rank processes
(``tests.vllm.scale_down_rank``: vLLM's plugin loading, vLLM's process
groups, the plugin's manager, vLLM's EPLB maps of a layer with 4 redundant
experts) and a ``TCPStore`` in this process, vLLM's recovery store. Rank 3
is killed between steps; the survivors read the fault as vLLM's runner
does, then run vLLM 0.34's real ``WorkerSentinel.handle_command`` of a
``FaultToleranceRequest("scale_down", ...)`` with the parameters vLLM's
engine gives a worker: its retry (``clean_buffers()`` adopts the view, the
DP group re-formed over the store, ``update_mask(3)`` replayed and
accepted) and its expert redistribution (rank 3's slots marked dead, the
maps committed by vLLM's own code). The view's members are 0-2, and the
steps after it equal the full model exactly: the tokens rank 3's experts
took are re-routed to their replicas, not dropped. Then the case where vLLM
names a rank the view still holds: refused, naming it.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from packaging.version import Version

from tests.multiprocess.harness import Sidecar, free_port, running_sidecar
from tests.multiprocess.test_peer_loss import STARTUP_S, Ranks
from tests.vllm.conftest import vllm_release

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.multiprocess,
    pytest.mark.timeout(540),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or Version(vllm_release()) < Version("0.34"),
        reason="scale_down is vLLM 0.34's (0.33's retry: test_fault_tolerance.py)",
    ),
]

WORLD = 4
KILLED = 3
SURVIVORS = (0, 1, 2)
BEFORE, AFTER = 2, 5
DEAD_SLOTS = {9, 10, 11}
"""Rank 3's physical slots (3 per rank)."""


class ScaleDownRanks(Ranks):
    """:class:`Ranks` running ``scale_down_rank`` instead."""

    command = (sys.executable, "-m", "tests.vllm.scale_down_rank")


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    """A real sidecar on a Unix socket in ``tmp_path``."""
    with running_sidecar(tmp_path / "sidecar", round_timeout=60.0) as running:
        yield running


def test_vllms_scale_down_recovers_through_the_masked_path(
    sidecar: Sidecar, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._C._distributed_c10d import TCPStore

    group = "vllm-ft:bf16/tp1-ep4/pp0"
    monkeypatch.setenv("FT_DP_PORT", str(free_port()))
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")  # vLLM's get_ip(): the store's host
    # vLLM's recovery store (EngineCoreSentinel._coordinate_recovery_store_port).
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    with ScaleDownRanks(tmp_path / "ranks", sidecar.target, group, policy="mask") as ranks:
        ready = ranks.expect(range(WORLD), "ready", STARTUP_S + 120)
        assert all(answer["support"] is True for answer in ready.values()), ready
        ranks.send(range(WORLD), f"steps 0 {BEFORE}")
        before = ranks.expect(range(WORLD), "stepped", 60)
        for rank, answer in before.items():
            assert [s["error"] for s in answer["steps"]] == [0.0] * BEFORE, (rank, answer)
        used = {slot for a in before.values() for s in a["steps"] for slot in s["slots"]}
        assert used & DEAD_SLOTS, used  # rank 3's replicas served tokens before

        ranks.kill(KILLED)
        ranks.send(SURVIVORS, "fault")
        for rank, answer in ranks.expect(SURVIVORS, "fault", 60).items():
            assert answer["fault"] is True and answer["mask"] == [0, 0, 0, 1], (rank, answer)

        for index, rank in enumerate(SURVIVORS):
            ranks.send([rank], f"scale_down {index} {len(SURVIVORS)} {store.port} round-1")
        for rank, answer in ranks.expect(SURVIVORS, "scaled", 180).items():
            assert answer["view"] == [2, list(SURVIVORS)], (rank, answer)
            assert answer["fault"] is False and answer["mask"] == [0, 0, 0, 1], (rank, answer)
            assert answer["dp_group_size"] == len(SURVIVORS), (rank, answer)
            assert answer["placement"][9:] == [-1, -1, -1], (rank, answer)
            assert answer["suppressed"] is True, (rank, answer)
        shown = sidecar.get_group(group).view
        assert (shown.number, list(shown.members)) == (2, list(SURVIVORS)), shown

        ranks.send(SURVIVORS, f"steps {BEFORE} {AFTER}")
        for rank, answer in ranks.expect(SURVIVORS, "stepped", 120).items():
            # Exact against the full model: re-routed, nothing dropped.
            assert [s["error"] for s in answer["steps"]] == [0.0] * AFTER, (rank, answer)
            assert not {x for s in answer["steps"] for x in s["slots"]} & DEAD_SLOTS, answer

        # vLLM naming a rank the committed view still holds: refused, by name.
        ranks.send([0], "update_mask 2")
        [refused] = ranks.expect([0], "raised", 30).values()
        assert refused["type"] == "PreconditionFailed", refused
        assert "EP rank 2 dead" in refused["message"] and "view 2" in refused["message"]
        ranks.send([1], "update_mask 3")
        assert ranks.expect([1], "masked", 30)

        ranks.send(SURVIVORS, "cleanup")
        ranks.expect(SURVIVORS, "cleaned", 30)
        exits = ranks.exits(SURVIVORS, 30)
        assert {r: code for r, (code, _) in exits.items()} == dict.fromkeys(SURVIVORS, 0)
