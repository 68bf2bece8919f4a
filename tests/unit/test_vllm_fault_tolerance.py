"""vLLM 0.33's fault-tolerance conversions and decisions, without vLLM.

FlashInfer's mask (bit i = rank i alive) against vLLM's (0 live, 1 masked),
when the manager says it supports fault tolerance, and the one change the
plugin makes to vLLM's sentinel module (a stand-in module here; the real
one is in tests/vllm/test_fault_tolerance.py).
"""

from __future__ import annotations

import enum
import logging
import sys
import types
from types import SimpleNamespace

import pytest

from moe_sidecar.client.engines.vllm.fault_tolerance import (
    FT_BACKEND,
    FT_BACKEND_SET_NAME,
    SENTINEL_MODULE,
    FaultToleranceUnsupported,
    VllmFaultTolerance,
    extend_ft_backends,
    masked_flags,
    supports_fault_tolerance,
)
from moe_sidecar.client.masked_alltoall import MaskedAlltoAll
from moe_sidecar.core.errors import InvalidArgument

pytestmark = pytest.mark.timeout(30)

VLLM_OWN = frozenset({"deepep_low_latency", "nixl_ep"})
"""vLLM 0.33's ``FT_BACKEND_SET``."""


class CUDAGraphMode(enum.Enum):
    """The names of vLLM 0.33's ``vllm.config.compilation.CUDAGraphMode`` that matter."""

    NONE = 0
    PIECEWISE = 1
    FULL_AND_PIECEWISE = 2


@pytest.mark.parametrize(
    ("active_mask", "ep_size", "lost", "flags"),
    [
        (0b1111, 4, (), [0, 0, 0, 0]),  # every rank a member
        (0b0111, 4, (), [0, 0, 0, 1]),  # view without rank 3
        (0b0011, 4, (), [0, 0, 1, 1]),
        (0b1111, 4, (2,), [0, 0, 1, 0]),  # rank 2 died, no view yet
        (0b0111, 4, (1,), [0, 1, 0, 1]),  # a second death under view 2
        (0b1, 1, (), [0]),
    ],
)
def test_flashinfer_members_become_vllms_masked_flags(
    active_mask: int, ep_size: int, lost: tuple[int, ...], flags: list[int]
) -> None:
    assert masked_flags(active_mask, ep_size, lost) == flags


@pytest.mark.parametrize(
    ("active_mask", "ep_size", "lost", "words"),
    [
        (0b1, 0, (), "ep_size=0"),
        (-1, 4, (), "active_mask=-0x1"),
        (0b10000, 4, (), "active_mask=0x10"),
        (0b1111, 4, (4,), "lost=[4]"),
    ],
)
def test_a_mask_outside_the_group_is_refused_naming_it(
    active_mask: int, ep_size: int, lost: tuple[int, ...], words: str
) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        masked_flags(active_mask, ep_size, lost)


def _config(*, ft: bool, mode: CUDAGraphMode | None, eager: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(enable_fault_tolerance=ft),
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
        model_config=SimpleNamespace(enforce_eager=eager),
    )


def test_vllms_config_is_read_as_the_manager_needs_it() -> None:
    assert VllmFaultTolerance.of(None) == VllmFaultTolerance(False, "NONE")
    on = VllmFaultTolerance.of(_config(ft=True, mode=CUDAGraphMode.NONE))
    assert on == VllmFaultTolerance(True, "NONE") and not on.cuda_graphs
    graphs = VllmFaultTolerance.of(_config(ft=True, mode=CUDAGraphMode.FULL_AND_PIECEWISE))
    assert graphs.cuda_graphs and graphs.cudagraph_mode == "FULL_AND_PIECEWISE"
    assert VllmFaultTolerance.of(_config(ft=False, mode=None, eager=True)).cudagraph_mode == "NONE"
    assert VllmFaultTolerance.of(_config(ft=False, mode=None)).cuda_graphs  # unresolved: capturing


EAGER_FT = VllmFaultTolerance(True, "NONE")
GRAPHS_FT = VllmFaultTolerance(True, "PIECEWISE")


@pytest.mark.parametrize(
    ("vllm", "masking", "sidecar", "backend", "supported"),
    [
        (EAGER_FT, True, True, "flashinfer-moe-ep", True),
        (EAGER_FT, True, True, "flashinfer", True),
        (EAGER_FT, True, True, "reference", True),
        (GRAPHS_FT, True, True, "flashinfer", True),  # MoeAlltoAll's mask takes graphs
        (GRAPHS_FT, True, True, "reference", True),
        (VllmFaultTolerance(False, "NONE"), True, True, "flashinfer-moe-ep", False),
        (VllmFaultTolerance(False, "PIECEWISE"), True, True, "flashinfer-moe-ep", False),
        (EAGER_FT, False, True, "flashinfer-moe-ep", False),  # not MOE_SIDECAR_ON_PEER_LOSS=mask
        (EAGER_FT, True, False, "reference", False),  # embedded: no views
        (GRAPHS_FT, False, True, "flashinfer-moe-ep", False),
    ],
)
def test_fault_tolerance_is_supported_only_with_vllms_and_ours_on(
    vllm: VllmFaultTolerance, masking: bool, sidecar: bool, backend: str, supported: bool
) -> None:
    got = supports_fault_tolerance(vllm, masking=masking, sidecar=sidecar, backend=backend)
    assert got is supported


def test_cuda_graphs_with_a_mask_that_refuses_capture_are_refused_naming_the_setting() -> None:
    with pytest.raises(FaultToleranceUnsupported) as raised:
        supports_fault_tolerance(GRAPHS_FT, masking=True, sidecar=True, backend="flashinfer-moe-ep")
    assert isinstance(raised.value, InvalidArgument)
    assert raised.value.field == "compilation_config.cudagraph_mode"
    assert raised.value.value == "PIECEWISE"
    message = str(raised.value)
    assert "compilation_config.cudagraph_mode='PIECEWISE'" in message
    assert "--enforce-eager" in message and "MOE_SIDECAR_ON_PEER_LOSS=mask" in message


@pytest.fixture
def sentinel_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in for vLLM's sentinel module, holding vLLM 0.33's set."""
    module = types.ModuleType(SENTINEL_MODULE)
    setattr(module, FT_BACKEND_SET_NAME, VLLM_OWN)
    monkeypatch.setitem(sys.modules, SENTINEL_MODULE, module)
    return module


def test_the_plugin_adds_only_our_backend_once_with_one_line(
    sentinel_module: types.ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.plugins.moe_sidecar"):
        assert extend_ft_backends("sidecar", masking=True)
        assert not extend_ft_backends("sidecar", masking=True)  # idempotent
    extended = getattr(sentinel_module, FT_BACKEND_SET_NAME)
    assert isinstance(extended, frozenset) and extended == VLLM_OWN | {FT_BACKEND}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert FT_BACKEND in lines[0] and "MOE_SIDECAR_ON_PEER_LOSS=mask" in lines[0]


@pytest.mark.parametrize(
    ("mode", "masking"), [("sidecar", False), ("embedded", True), (None, True)]
)
def test_the_set_stays_vllms_where_the_manager_cannot_serve_it(
    sentinel_module: types.ModuleType, mode: str | None, masking: bool
) -> None:
    assert not extend_ft_backends(mode, masking=masking)
    assert getattr(sentinel_module, FT_BACKEND_SET_NAME) is VLLM_OWN


def test_a_vllm_without_the_sentinel_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, SENTINEL_MODULE, None)
    assert not extend_ft_backends("sidecar", masking=True)


class _Recorder:
    """An all-to-all that records the masks its calls get."""

    def __init__(self) -> None:
        self.combines: list[int | None] = []

    def dispatch(self, *args: object, active_rank_mask: int | None = None) -> None:
        return None

    def combine(self, *args: object, active_rank_mask: int | None = None) -> None:
        self.combines.append(active_rank_mask)


class _Source:
    def __init__(self, mask: int | None) -> None:
        self.mask = mask
        self.rounds = 0

    def step_mask(self) -> int | None:
        return self.mask

    def round_done(self) -> None:
        self.rounds += 1


def test_a_dispatch_cut_short_leaves_no_mask_for_the_next_combine() -> None:
    inner, source = _Recorder(), _Source(0b1111)
    wrapper = MaskedAlltoAll(inner, source)
    wrapper.dispatch("tokens")  # the fault: its combine never comes
    wrapper.reset_step()  # clean_buffers()
    source.mask = 0b0111  # the view adopted at the retry
    wrapper.combine("payload")
    assert inner.combines == [None]
    wrapper.dispatch("tokens")
    wrapper.combine("payload")
    assert inner.combines == [None, 0b0111] and source.rounds == 2
