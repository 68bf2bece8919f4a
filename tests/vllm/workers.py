"""Rank-side code of the vLLM tests: vLLM's own test code, run against our manager.

Imported only in spawned rank processes (tests/multiprocess/harness.py's
``run_ranks`` starts them and joins them into a 2-rank gloo world), with
``MOE_SIDECAR_BACKEND=reference`` and either ``MOE_SIDECAR_TARGET`` (a real
sidecar) or ``MOE_SIDECAR_VLLM=1`` (embedded) in the environment.

What is vLLM's, and from where in vLLM's repository:

* ``_init_dp_environment``: vLLM's test helper (``tests/distributed/
  test_mnnvl_alltoall.py``, the copy at PR #42976), with the changes a CPU
  machine needs marked ``# CPU:``;
* ``_one_sided_workspace_grow_worker``: vLLM PR #42976's regression test
  body, **verbatim** (the PR-era text as stored, with ``aphrodite`` names
  turned back into ``vllm``: the notes say which fork kept it);
* ``_one_sided_workspace_grow_worker_v030``: the same body as it reads at
  vLLM 0.30 (commit 030ea52): only the two keyword dicts differ;
* the 0.33 contract: tests/contracts.py, on vLLM's EP group.

The plugin is loaded first, by vLLM's own ``load_general_plugins()``, as
``WorkerWrapperBase.init_worker`` does in a vLLM worker before the process
groups are built.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tests.build_log import recording_builds

# --- vLLM's helper, tests/distributed/test_mnnvl_alltoall.py ---------------------


def _init_dp_environment(world_size, rank, port, dp_size, dp_port):
    """Initialize distributed env with data parallelism.

    Sets up tp=1, pp=1, dp=dp_size. Each process is one DP rank
    with local rank 0 within its (trivial) tp*pp group.

    Args:
        port: Port for torch.distributed init.
        dp_port: Separate port for the DP master group init.
    """
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.config.parallel import ParallelConfig
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    # CPU: VllmConfig() alone fails with "Failed to infer device type".
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vllm_config.parallel_config = ParallelConfig(
        data_parallel_size=dp_size,
        data_parallel_rank=rank,
        # Pre-populate port list so __post_init__ doesn't auto-generate
        # random ports. All DP ranks must agree on the same port.
        _data_parallel_master_port_list=[int(dp_port)],
    )
    with set_current_vllm_config(vllm_config):
        # rank=0 here because each DP rank has a single (tp=1,pp=1) process,
        # so the local rank within the tp*pp group is always 0.
        # init_distributed_environment will offset by data_parallel_rank.
        # CPU: torch.distributed is already initialized over gloo by the
        # harness, and vLLM builds its groups on it (the init method is not
        # used); they must be gloo groups too, not the default nccl.
        init_distributed_environment(
            world_size=1,  # tp * pp = 1
            rank=0,
            distributed_init_method=f"tcp://localhost:{port}",
            local_rank=rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
    return vllm_config


# --- vLLM PR #42976's regression test body, verbatim ------------------------------


# fmt: off
def _one_sided_workspace_grow_worker(rank, world_size):
    from vllm.distributed.device_communicators.all2all import (
        FlashInferNVLinkOneSidedManager,
    )
    from vllm.distributed.parallel_state import get_dp_group

    cpu_group = get_dp_group().cpu_group
    manager = FlashInferNVLinkOneSidedManager(cpu_group)

    base_kwargs = dict(
        max_num_tokens=1024,
        top_k=2,
        num_experts=world_size * 8,
        hidden_size=4096,
    )
    nvfp4_kwargs = dict(
        dispatch_dtype_bytes_per_elem=0,
        dispatch_scale_bytes_per_token=base_kwargs["hidden_size"] // 16,
    )
    bf16_kwargs = dict(
        dispatch_dtype_bytes_per_elem=2,
        dispatch_scale_bytes_per_token=0,
    )

    # First init: NVFP4-like (hidden_bytes = hidden // 2 + hidden // 16).
    manager.initialize(**base_kwargs, **nvfp4_kwargs)
    assert manager.initialized
    nvfp4_workspace_size = manager.workspace_size
    nvfp4_moe_alltoall = manager.moe_alltoall

    torch.distributed.barrier()

    # Second init: bf16-like (hidden_bytes = hidden * 2). Models the case of
    # a quantized base MoE followed by an unquantized MoE layer (e.g. an MTP
    # head). Per-token dispatch payload is ~4x larger, so the union workspace
    # must grow and MoeAlltoAll must be rebuilt.
    manager.initialize(**base_kwargs, **bf16_kwargs)
    assert manager.initialized
    assert manager.workspace_size > nvfp4_workspace_size
    assert manager.moe_alltoall is not nvfp4_moe_alltoall
    bf16_workspace_size = manager.workspace_size
    bf16_moe_alltoall = manager.moe_alltoall

    torch.distributed.barrier()

    # Third init: back to NVFP4-like shape. Existing workspace already covers
    # it, so initialize() must no-op — no shrink, no rebuild.
    manager.initialize(**base_kwargs, **nvfp4_kwargs)
    assert manager.initialized
    assert manager.workspace_size == bf16_workspace_size
    assert manager.moe_alltoall is bf16_moe_alltoall

    torch.distributed.barrier()
    manager.cleanup()
# fmt: on


# --- the same body at vLLM 0.30 (commit 030ea52): only the keyword dicts differ ----


# fmt: off
def _one_sided_workspace_grow_worker_v030(rank, world_size):
    from vllm.distributed.device_communicators.all2all import (
        FlashInferNVLinkOneSidedManager,
    )
    from vllm.distributed.parallel_state import get_dp_group

    cpu_group = get_dp_group().cpu_group
    manager = FlashInferNVLinkOneSidedManager(cpu_group)

    base_kwargs = dict(
        max_num_tokens=1024,
        top_k=2,
        num_experts=world_size * 8,
        hidden_size=4096,
    )
    hidden = base_kwargs["hidden_size"]
    nvfp4_kwargs = dict(x_bytes_per_token=hidden // 2, x_sf_bytes_per_token=hidden // 16)
    bf16_kwargs = dict(x_bytes_per_token=hidden * 2, x_sf_bytes_per_token=0)

    # First init: NVFP4-like (hidden_bytes = hidden // 2 + hidden // 16).
    manager.initialize(**base_kwargs, **nvfp4_kwargs)
    assert manager.initialized
    nvfp4_workspace_size = manager.workspace_size
    nvfp4_moe_alltoall = manager.moe_alltoall

    torch.distributed.barrier()

    # Second init: bf16-like (hidden_bytes = hidden * 2). Models the case of
    # a quantized base MoE followed by an unquantized MoE layer (e.g. an MTP
    # head). Per-token dispatch payload is ~4x larger, so the union workspace
    # must grow and MoeAlltoAll must be rebuilt.
    manager.initialize(**base_kwargs, **bf16_kwargs)
    assert manager.initialized
    assert manager.workspace_size > nvfp4_workspace_size
    assert manager.moe_alltoall is not nvfp4_moe_alltoall
    bf16_workspace_size = manager.workspace_size
    bf16_moe_alltoall = manager.moe_alltoall

    torch.distributed.barrier()

    # Third init: back to NVFP4-like shape. Existing workspace already covers
    # it, so initialize() must no-op — no shrink, no rebuild.
    manager.initialize(**base_kwargs, **nvfp4_kwargs)
    assert manager.initialized
    assert manager.workspace_size == bf16_workspace_size
    assert manager.moe_alltoall is bf16_moe_alltoall

    torch.distributed.barrier()
    manager.cleanup()
# fmt: on


# --- what the tests run in each rank ----------------------------------------------


def _part(results: dict[str, Any], name: str, run: Callable[[], Any]) -> None:
    """Runs one part; keeps its value or its traceback, and its builds (and
    goes on: the other rank runs the same parts in the same order, so
    nothing waits alone)."""
    with recording_builds() as log:
        try:
            results[name] = {"ok": True, "value": run()}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
    results[name]["builds"] = log.builds


def _with_group(name: str | None, run: Callable[[], Any]) -> Callable[[], Any]:
    def wrapped() -> Any:
        if name is None:
            os.environ.pop("MOE_SIDECAR_GROUP", None)
        else:
            os.environ["MOE_SIDECAR_GROUP"] = name
        return run()

    return wrapped


def vllm_rank(rank: int, world_size: int, dp_port: int, mode: str) -> dict[str, Any]:
    """Everything the vLLM tests check, in one vLLM process per rank."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what WorkerWrapperBase.init_worker does first
    vllm_config = _init_dp_environment(world_size, rank, 0, world_size, dp_port)
    results: dict[str, Any] = {}

    def constructed() -> dict[str, Any]:
        import vllm.distributed.device_communicators.all2all as a2a

        # The statement vLLM's CudaCommunicator runs (cuda_communicator.py:267-270).
        from vllm.distributed.device_communicators.all2all import (
            FlashInferNVLinkOneSidedManager,
        )
        from vllm.distributed.parallel_state import get_ep_group

        manager = FlashInferNVLinkOneSidedManager(get_ep_group().cpu_group)
        out = {
            "class": type(manager).__name__,
            "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(manager).__mro__],
            "is_module_attribute": type(manager) is a2a.FlashInferNVLinkOneSidedManager,
            "generation": type(manager).vllm_generation.value,
            "group": manager.group,
            "embedded": manager.embedded,
            "rank": (manager.rank, manager.world_size, manager.dp_rank, manager.dp_world_size),
            "internode": manager.internode,
        }
        manager.cleanup()
        return out

    _part(results, "constructed", _with_group(None, constructed))
    # A fresh group for each body: against one sidecar group, a second run
    # would start from the first one's plan (a warm restart), which these
    # bodies, written for a fresh manager, do not expect.
    _part(
        results,
        "pr42976",
        _with_group(None, lambda: _one_sided_workspace_grow_worker(rank, world_size)),
    )
    _part(
        results,
        "v030",
        _with_group(
            f"vllm-test:{mode}/v030",
            lambda: _one_sided_workspace_grow_worker_v030(rank, world_size),
        ),
    )
    _part(
        results,
        "v033",
        _with_group(f"vllm-test:{mode}/v033", lambda: _v033(rank, world_size, vllm_config)),
    )
    _part(
        results,
        "fused_output",
        _with_group(
            f"vllm-test:{mode}/fused-output",
            lambda: _v033(rank, world_size, vllm_config, grown=False),
        ),
    )
    torch.distributed.barrier()
    from vllm.distributed.parallel_state import destroy_model_parallel

    destroy_model_parallel()
    return results


def _v033(rank: int, world_size: int, vllm_config: Any, *, grown: bool = True) -> dict[str, Any]:
    """vLLM 0.33's capacity contract on vLLM's EP group, then the installed
    vLLM's own prepare/finalize (the class that asserts ``isinstance``; 0.33's
    or 0.34's, whose ``prepare`` passes ``runtime_max_tokens_per_rank=``)
    dispatching and combining a bf16 layer through ``get_communication()``,
    the expert output written where ``allocate_fused_expert_output`` says
    (vLLM 0.34's combine input buffer; the base class's None on 0.33).
    ``grown=False``: without the contract's layers first, so the
    prepare/finalize layer alone is the union."""
    from vllm.distributed.device_communicators.all2all import FlashInferNVLinkOneSidedManager
    from vllm.distributed.parallel_state import get_ep_group
    from vllm.forward_context import get_forward_context, set_forward_context
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.flashinfer_nvlink_one_sided import (
        FlashInferNVLinkOneSidedPrepareAndFinalize,
    )
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceNoOP,
    )

    from moe_sidecar.client.backends.reference import live_workspace_bytes
    from tests.contracts import QuantFormat, v033_capacity_contract
    from tests.exchange import token_values

    ep = get_ep_group()
    manager = FlashInferNVLinkOneSidedManager(ep.cpu_group)
    shared = v033_capacity_contract(manager, world_size, QuantFormat)["shared"] if grown else None
    out: dict[str, Any] = {
        "workspace_size": manager.workspace_size,
        "live": live_workspace_bytes(),
        "params": None
        if shared is None
        else (shared.params.hidden_size, shared.params.max_tokens_per_rank),
    }

    # What CudaCommunicator does with the manager it builds for the EP group
    # (cuda_communicator.py:267-270: self.all2all_manager = ...); on a CPU
    # platform vLLM builds a DeviceCommunicatorBase, whose all2all_manager is None.
    assert ep.device_communicator is not None
    ep.device_communicator.all2all_manager = manager
    hidden, tokens, top_k, experts = 6144, 96, 4, world_size * 8
    # vLLM 0.33's call site for a bf16 layer (all2all_utils.py:402-418).
    prepare_finalize = FlashInferNVLinkOneSidedPrepareAndFinalize(
        max_num_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        top_k=top_k,
        num_experts=experts,
        hidden_size=hidden,
        num_dispatchers=manager.world_size,
        dispatch_format=QuantFormat.BF16,
        extra_payload_bytes_per_token=0,
    )
    out["max_num_batched_tokens"] = vllm_config.scheduler_config.max_num_batched_tokens
    out["after_prepare_finalize"] = manager.workspace_size
    out["same_communication"] = manager.get_communication() is shared

    g = torch.Generator().manual_seed(rank)
    a1 = token_values(torch.arange(tokens) + rank * tokens, hidden)
    topk_ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
    topk_weights = torch.full((tokens, top_k), 0.5)
    with set_forward_context(
        None,
        vllm_config,
        num_tokens=tokens,
        num_tokens_across_dp=torch.tensor([tokens] * world_size, dtype=torch.int32),
    ):
        dp_metadata = get_forward_context().dp_metadata
        assert dp_metadata is not None
        with dp_metadata.sp_local_sizes(1):
            recv_x, recv_sf, _, recv_ids, recv_weights = prepare_finalize.prepare(
                a1,
                topk_weights,
                topk_ids,
                experts,
                None,
                False,
                FUSED_MOE_UNQUANTIZED_CONFIG,
            )
            per_rank = experts // world_size
            owned = (recv_ids >= rank * per_rank) & (recv_ids < (rank + 1) * per_rank)
            factor = (recv_weights * owned.float()).sum(dim=-1, keepdim=True)
            expert_output = (recv_x.float() * factor).to(torch.bfloat16)
            # vLLM 0.34's modular kernel asks its prepare/finalize for the
            # expert output buffer (modular_kernel.py, _allocate_buffers): the
            # one-sided one hands out get_combine_input_buffer()'s, shape-checked.
            buffer = prepare_finalize.allocate_fused_expert_output(
                tuple(expert_output.shape),
                torch.bfloat16,
                expert_output.device,
                TopKWeightAndReduceNoOP(),
            )
            out["fused_output_buffer"] = None if buffer is None else list(buffer.shape)
            if buffer is not None:
                buffer.copy_(expert_output)
                expert_output = buffer
            output = torch.empty(tokens, hidden, dtype=torch.bfloat16)
            prepare_finalize.finalize(
                output, expert_output, topk_weights, topk_ids, False, TopKWeightAndReduceNoOP()
            )
    expected = a1.float() * topk_weights.sum(dim=-1, keepdim=True)
    out["prepare_shapes"] = [list(recv_x.shape), recv_sf, list(recv_ids.shape)]
    out["finalize_error"] = float((output.float() - expected).abs().max())
    manager.cleanup()
    out["live_after_cleanup"] = live_workspace_bytes()
    return out
