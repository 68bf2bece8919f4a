"""vLLM 0.33's own prepare/finalize calling FlashInfer 0.7.4's ``NVLinkOneSidedAlltoAll``.

vLLM 0.33's ``FlashInferNVLinkOneSidedPrepareAndFinalize.prepare`` calls
``communication.dispatch(x, topk_ids, topk_weights, hidden_states_scale=...,
max_tokens_per_rank=...)``: 0.7.2.post1's keyword. On CPU no all-to-all can
be built, so the objects here are FlashInfer's class (or the client's
subclass of it) with the state FlashInfer's ``dispatch`` reads before any
kernel: no workspace. That is enough to see where each call goes: FlashInfer's
plain class refuses vLLM's call with a TypeError; the client's passes vLLM's
value into FlashInfer's own ``runtime_max_tokens_per_rank`` check, which
refuses a value above the capacity by name. The real dispatch and combine run
on the GPU machine (tests/gpu/test_fi074_alltoall.py).

Through the plugin: vLLM's ``load_general_plugins()`` and its EP group in a
rank process, then vLLM's own statement building the manager: in a 0.7.4
environment the manager is ours, with the ``flashinfer-moe-ep`` backend.

vLLM's prepare/finalize object is made without its ``__init__`` (which needs
vLLM's EP group and a built manager); its ``all2all_manager`` is an object
whose ``get_communication()`` returns the communication object under test.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from typing import Any

import pytest
from packaging.version import Version

pytestmark = [pytest.mark.fi074, pytest.mark.vllm, pytest.mark.timeout(300)]

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI_REQUIRE_VLLM") == "1":
        raise RuntimeError("CI_REQUIRE_VLLM=1 but vllm is not importable")
    pytest.skip("vllm is not importable", allow_module_level=True)

TOKENS, HIDDEN, TOP_K, EXPERTS, CAPACITY = 8, 256, 2, 8, 4


class _Manager:
    """Hands vLLM's prepare/finalize the communication object under test."""

    def __init__(self, communication: Any) -> None:
        self.communication = communication

    def get_communication(self) -> Any:
        return self.communication


def _unbuilt(cls: Any) -> Any:
    """``cls`` with what FlashInfer's ``dispatch`` reads before a kernel: params,
    config, ranks, an idle round state; no workspace."""
    import torch

    moe_ep = importlib.import_module("flashinfer.moe_ep")
    obj = object.__new__(cls)
    obj.params = moe_ep.MoEEpCommParams(
        num_experts=EXPERTS,
        top_k=TOP_K,
        max_tokens_per_rank=CAPACITY,
        hidden_size=HIDDEN,
        dtype=torch.bfloat16,
    )
    obj.config = moe_ep.NVLinkOneSidedConfig(cft=False, lamport=False)
    obj.ep_rank, obj.ep_size = 0, 2
    obj._state = {"round_owner": None}
    obj._round = None
    return obj


def _prepare_finalize(communication: Any) -> tuple[Any, Any]:
    import torch
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.flashinfer_nvlink_one_sided import (
        FlashInferNVLinkOneSidedPrepareAndFinalize,
    )
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceNoOP,
    )

    pf = object.__new__(FlashInferNVLinkOneSidedPrepareAndFinalize)
    pf.all2all_manager = _Manager(communication)
    a1 = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)
    ids = torch.zeros(TOKENS, TOP_K, dtype=torch.int32)
    weights = torch.full((TOKENS, TOP_K), 0.5)
    errors: list[Any] = []
    with set_forward_context(None, VllmConfig(device_config=DeviceConfig(device="cpu"))):
        try:
            pf.prepare(a1, weights, ids, EXPERTS, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
        except Exception as error:
            errors.append(error)
        try:
            output = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
            pf.finalize(output, a1, weights, ids, False, TopKWeightAndReduceNoOP())
        except Exception as error:
            errors.append(error)
    return errors[0], errors[1]


VLLM_034 = Version(importlib.metadata.version("vllm")) >= Version("0.34")
"""vLLM 0.34's prepare passes ``runtime_max_tokens_per_rank=``, 0.33's ``max_tokens_per_rank=``."""


@pytest.mark.skipif(VLLM_034, reason="vLLM 0.33's keyword; 0.34's counterpart below")
def test_flashinfer_0_7_4_refuses_vllm_0_33s_dispatch_keyword() -> None:
    base = importlib.import_module("flashinfer.moe_ep").NVLinkOneSidedAlltoAll
    dispatch_error, combine_error = _prepare_finalize(_unbuilt(base))
    assert isinstance(dispatch_error, TypeError)
    assert "max_tokens_per_rank" in str(dispatch_error)
    # finalize's combine(expert_output, output=) binds: FlashInfer's own check speaks.
    assert isinstance(combine_error, RuntimeError)
    assert "combine called before dispatch" in str(combine_error)


@pytest.mark.skipif(not VLLM_034, reason="vLLM 0.34's keyword; 0.33's counterpart above")
def test_flashinfer_0_7_4_takes_vllm_0_34s_dispatch_keyword() -> None:
    base = importlib.import_module("flashinfer.moe_ep").NVLinkOneSidedAlltoAll
    dispatch_error, combine_error = _prepare_finalize(_unbuilt(base))
    # vLLM 0.34 names it runtime_max_tokens_per_rank: FlashInfer's own check
    # receives a1.shape[0]=8 and refuses it by name, no keyword mismatch.
    assert isinstance(dispatch_error, ValueError)
    assert f"runtime_max_tokens_per_rank={TOKENS} must be in (0, {CAPACITY}]" in str(dispatch_error)
    # finalize's combine(expert_output, output=) binds: FlashInfer's own check speaks.
    assert isinstance(combine_error, RuntimeError)
    assert "combine called before dispatch" in str(combine_error)


def test_the_clients_object_takes_vllms_keyword_into_flashinfers_check() -> None:
    from moe_sidecar.client.backends.flashinfer_moe_ep import vllm_compatible_class

    dispatch_error, combine_error = _prepare_finalize(_unbuilt(vllm_compatible_class()))
    # vLLM passed max_tokens_per_rank=a1.shape[0]=8 (no DP metadata); FlashInfer's
    # own _resolve_runtime_max_tokens_per_rank received it and refused it by name.
    assert isinstance(dispatch_error, ValueError)
    assert f"runtime_max_tokens_per_rank={TOKENS} must be in (0, {CAPACITY}]" in str(dispatch_error)
    assert isinstance(combine_error, RuntimeError)
    assert "combine called before dispatch" in str(combine_error)


def test_both_names_must_agree() -> None:
    import torch

    from moe_sidecar.client.backends.flashinfer_moe_ep import vllm_compatible_class

    obj = _unbuilt(vllm_compatible_class())
    x = torch.ones(1, HIDDEN, dtype=torch.bfloat16)
    ids = torch.zeros(1, TOP_K, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_tokens_per_rank=2 and runtime_max_tokens_per_rank=3"):
        obj.dispatch(x, ids, max_tokens_per_rank=2, runtime_max_tokens_per_rank=3)


def _plugin_rank(rank: int, world_size: int, dp_port: int) -> dict[str, Any]:
    """vLLM's plugin loading and its EP group, then the statement vLLM's
    CudaCommunicator runs to build the manager."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what WorkerWrapperBase.init_worker does first
    from tests.vllm.workers import _init_dp_environment

    _init_dp_environment(world_size, rank, 0, world_size, dp_port)
    from vllm.distributed.device_communicators.all2all import FlashInferNVLinkOneSidedManager
    from vllm.distributed.parallel_state import destroy_model_parallel, get_ep_group

    manager = FlashInferNVLinkOneSidedManager(get_ep_group().cpu_group)
    out = {
        "class": type(manager).__name__,
        "generation": type(manager).vllm_generation.value,
        "backend": manager.backend.name,
        "backend_module": type(manager.backend).__module__,
    }
    manager.cleanup()
    destroy_model_parallel()
    return out


@pytest.mark.multiprocess
def test_through_the_plugin_vllm_0_33_gets_the_0_7_4_backend(tmp_path: Any) -> None:
    # Construction only: a build would compile FlashInfer's CUDA module.
    from tests.multiprocess.harness import free_port, run_ranks

    [result] = run_ranks(
        _plugin_rank,
        1,
        timeout=200,
        tmp_path=tmp_path,
        args=(free_port(),),
        envs=[{"MOE_SIDECAR_VLLM": "1", "MOE_SIDECAR_TARGET": "", "MOE_SIDECAR_BACKEND": ""}],
    )
    assert result == {
        "class": "MoeSidecarOneSidedManager",
        "generation": "vLLM 0.33",
        "backend": "flashinfer-moe-ep",
        "backend_module": "moe_sidecar.client.backends.flashinfer_moe_ep",
    }
