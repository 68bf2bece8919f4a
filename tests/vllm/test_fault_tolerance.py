"""vLLM 0.33's fault tolerance driving moe-sidecar's manager: a death, vLLM's
fault check, vLLM's own ``WorkerSentinel.retry``, exact steps after it.

Real processes throughout: a ``python -m moe_sidecar`` process and four rank
processes (``tests.vllm.fault_tolerance_rank``): each loads the plugin with
vLLM's ``load_general_plugins()``, builds vLLM's process groups on a gloo
world (DP 4, EP 4), constructs the plugin's manager as vLLM's
``CudaCommunicator`` does under ``enable_fault_tolerance`` with
``all2all_backend="flashinfer_nvlink_one_sided"``, and steps exactly through
what vLLM's ``get_ep_all2all_manager()`` returns (reference backend, CPU,
``MOE_SIDECAR_ON_PEER_LOSS=mask``). Rank 3 is killed (SIGKILL) between steps;
the survivors read ``query_fault()`` as vLLM's model runner does after a step
until it says True, and ``query_active_mask()`` then shows rank 3 masked. Each
survivor then runs vLLM's real ``WorkerSentinel`` (constructed for our backend:
the plugin added it to ``FT_BACKEND_SET``) and its ``handle_command`` of a real
``retry`` request: vLLM's order (synchronize, clear the runner's requests,
``clean_buffers()``, the DP group re-formed over the survivors). The smallest
real piece: the sentinel's ``worker`` is a stand-in holding what it reads (a
GPU worker cannot be built on CPU), ``torch.accelerator.synchronize`` a no-op.
After the retry the fault is gone, the view committed (members 0, 1, 2), and 5
more steps equal the routing's results without rank 3's experts.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.version import Version

from moe_sidecar.client.engines.vllm.fault_tolerance import FT_BACKEND
from tests.multiprocess.harness import Sidecar, free_port, running_sidecar
from tests.multiprocess.test_masked_view import WORLD, _check_steps
from tests.multiprocess.test_peer_loss import STARTUP_S, Ranks
from tests.vllm.conftest import vllm_release

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(540)]

KILLED = 3
SURVIVORS = (0, 1, 2)
BEFORE = 2
AFTER = 5
VLLM_FT_BACKENDS = ["deepep_low_latency", "nixl_ep"]
"""vLLM 0.33's own ``FT_BACKEND_SET``."""


class FaultToleranceRanks(Ranks):
    """:class:`Ranks` running ``fault_tolerance_rank`` instead."""

    command = (sys.executable, "-m", "tests.vllm.fault_tolerance_rank")


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    """A real sidecar on a Unix socket in ``tmp_path``."""
    with running_sidecar(tmp_path / "sidecar", round_timeout=60.0) as running:
        yield running


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or Version(vllm_release()) >= Version("0.34"),
    reason="vLLM 0.33's retry request; vLLM 0.34's retry runs inside test_scale_down.py",
)
def test_vllms_retry_adopts_the_view_and_the_survivors_step_exactly(
    sidecar: Sidecar, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = "vllm-ft:fp4/tp1-ep4/pp0"
    everyone = (1 << WORLD) - 1
    survivors_mask = everyone & ~(1 << KILLED)
    monkeypatch.setenv("FT_DP_PORT", str(free_port()))
    with FaultToleranceRanks(tmp_path / "ranks", sidecar.target, group, policy="mask") as ranks:
        ready = ranks.expect(range(WORLD), "ready", STARTUP_S + 120)
        for rank, answer in ready.items():
            assert answer["cls"] == "MoeSidecarOneSidedManager", (rank, answer)
            assert answer["support"] is True, (rank, answer)
            assert answer["ft_backends"] == sorted([*VLLM_FT_BACKENDS, FT_BACKEND]), answer
            assert answer["fault"] is False and answer["mask"] == [0] * WORLD, (rank, answer)
            assert answer["fault_tensor"] == ["torch.bool", [], "cpu"], (rank, answer)
            assert answer["mask_tensor"] == ["torch.int32", [WORLD], "cpu"], (rank, answer)
        ranks.send(range(WORLD), f"steps 0 {BEFORE}")
        assert (
            _check_steps(ranks.expect(range(WORLD), "stepped", 60), 0, BEFORE, set(), everyone) == 0
        )

        ranks.kill(KILLED)  # between steps: every survivor has quiesced
        ranks.send(SURVIVORS, "fault")
        for rank, answer in ranks.expect(SURVIVORS, "fault", 60).items():
            assert answer["fault"] is True, (rank, answer)
            assert answer["mask"] == [0, 0, 0, 1], (rank, answer)  # heard of, no view yet
            assert answer["active_mask"] == everyone, (rank, answer)

        port = free_port()
        for index, rank in enumerate(SURVIVORS):
            ranks.send([rank], f"retry {index} {len(SURVIVORS)} {port}")
        for rank, answer in ranks.expect(SURVIVORS, "retried", 180).items():
            assert answer["view"] == [2, list(SURVIVORS)], (rank, answer)
            assert answer["fault"] is False, (rank, answer)
            assert answer["mask"] == [0, 0, 0, 1], (rank, answer)  # masked by the view now
            assert answer["active_mask"] == survivors_mask, (rank, answer)
            assert answer["dp_group_size"] == len(SURVIVORS), (rank, answer)
        shown = sidecar.get_group(group).view
        assert (shown.number, list(shown.members)) == (2, list(SURVIVORS)), shown

        ranks.send(SURVIVORS, f"steps {BEFORE} {AFTER}")
        after = ranks.expect(SURVIVORS, "stepped", 120)
        assert _check_steps(after, BEFORE, AFTER, {KILLED}, survivors_mask) > 0

        ranks.send(SURVIVORS, "cleanup")
        ranks.expect(SURVIVORS, "cleaned", 30)
        exits = ranks.exits(SURVIVORS, 30)
        assert {r: code for r, (code, _) in exits.items()} == dict.fromkeys(SURVIVORS, 0)


def test_the_manager_reads_vllms_own_config_objects() -> None:
    """``VllmFaultTolerance.current()`` on vLLM 0.33's real ``VllmConfig``: the
    switch and the CUDA-graph mode (a CPU platform resolves the mode to
    ``NONE``; a GPU config holds a capturing one, set here as it would be)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode

    from moe_sidecar.client.engines.vllm.fault_tolerance import (
        FaultToleranceUnsupported,
        VllmFaultTolerance,
        supports_fault_tolerance,
    )

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        assert VllmFaultTolerance.current() == VllmFaultTolerance(False, "NONE")
    config.parallel_config.enable_fault_tolerance = True
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    with set_current_vllm_config(config):
        read = VllmFaultTolerance.current()
    assert read == VllmFaultTolerance(True, "FULL_AND_PIECEWISE") and read.cuda_graphs
    assert VllmFaultTolerance.current() == VllmFaultTolerance(
        False, "NONE"
    )  # outside vLLM's context
    with pytest.raises(FaultToleranceUnsupported, match="cudagraph_mode='FULL_AND_PIECEWISE'"):
        supports_fault_tolerance(read, masking=True, sidecar=True, backend="flashinfer-moe-ep")
