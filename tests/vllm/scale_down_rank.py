"""One rank of ``test_scale_down.py``: ``python -m tests.vllm.scale_down_rank RANK
WORLD INIT_METHOD GROUP``, with ``MOE_SIDECAR_TARGET``,
``MOE_SIDECAR_ON_PEER_LOSS=mask`` and ``FT_DP_PORT`` in its environment.

As ``tests.vllm.fault_tolerance_rank`` (vLLM's ``load_general_plugins()``,
vLLM's process groups over gloo, the plugin's manager built as vLLM's
``CudaCommunicator`` builds it, one layer through the sidecar), with vLLM
0.34's EPLB: one MoE layer of 8 logical experts on 12 physical slots (3 per
EP rank, 4 redundant), whose maps are committed by vLLM's own
``_commit_eplb_maps``. A step routes each token's logical top-k to physical
slots as vLLM's EPLB kernel picks a replica (``eplb_triton.eplb_map_and_record``:
the Knuth hash of the token's index modulo the replica count), dispatches
and combines through what ``get_ep_all2all_manager()`` returns with vLLM
0.34's keyword (``runtime_max_tokens_per_rank=``), each rank computing its
slots' logical experts (expert ``l`` scales a token by ``l + 1``). Commands,
one a line:

* ``steps FIRST COUNT``: ``stepped`` with each step's largest error against
  the full model (every token's top-k experts) and the physical slots used;
* ``fault``: vLLM's fault check after a step until it reads a fault: ``fault``;
* ``scale_down INDEX SIZE STORE_PORT ROUND``: vLLM 0.34's own ``WorkerSentinel``
  and its ``handle_command`` of ``FaultToleranceRequest("scale_down", ...)``
  with the parameters vLLM's ``EngineCoreSentinel`` gives a worker (the
  recovery store a real ``TCPStore`` the test hosts): ``scaled`` with the
  manager's view, the maps after vLLM's redistribution, or ``raised``;
* ``update_mask RANK``: the manager's ``update_mask(RANK, masked=True)``:
  ``masked`` or ``raised``;
* ``cleanup``: ``cleanup()`` and a clean exit.

The sentinel's ``worker`` is a stand-in holding what vLLM 0.34's
``WorkerSentinel`` reads (its parallel settings, the EPLB config, a model
runner with the EPLB state, the real ``VllmConfig``); the EPLB state holds
what ``reset_eplb_async_state``, ``_redistribute_experts`` and
``_commit_eplb_maps`` read. Every dead rank's logical expert has a replica on
a survivor, so vLLM's redistribution re-hosts nothing from disk
(``reload_experts_from_disk`` reads a checkpoint).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tests.exchange import token_values
from tests.multiprocess.workers import failure_report

WATCHDOG_S = 560.0
FAULT_WAIT_S = 30.0
SLOTS_PER_RANK = 3
LOGICAL = 8
PLACEMENT = [0, 1, 2, 3, 4, 5, 6, 7, 3, 0, 1, 2]
"""Physical slot -> logical expert: rank 3's slots (9-11) hold experts 0-2,
which ranks 0 also hosts."""
REDUNDANT = len(PLACEMENT) - LOGICAL
TOKENS, TOP_K, HIDDEN = 8, 2, 64
KNUTH_MULTIPLIER = 2654435769
"""vLLM's ``eplb_map_and_record``: floor(2^32 / phi)."""


def _say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}), flush=True)


class _ModelConfig:
    """What ``hash_config_cached`` reads of the model config: its compile factors."""

    def compile_factors(self) -> dict[str, str]:
        return {"model": "scale-down-test"}


def _eplb_state(model_config: _ModelConfig) -> Any:
    """The EPLB state of one MoE layer, its maps committed by vLLM's own code."""
    import vllm.distributed.eplb.eplb_state as eplb
    from vllm.config.utils import hash_config_cached
    from vllm.distributed.eplb.eplb_state import _commit_eplb_maps

    eplb.PIN_MEMORY = False  # CPU: no pinned-memory allocator (vLLM reads it at each commit)

    p2l = torch.tensor([PLACEMENT], dtype=torch.int64)
    state = SimpleNamespace(
        physical_to_logical_map=p2l.clone(),
        physical_to_logical_map_buffer=p2l.clone(),
        logical_to_physical_map=torch.full((1, LOGICAL, REDUNDANT + 1), -1, dtype=torch.int64),
        logical_replica_count=torch.zeros(1, LOGICAL, dtype=torch.int64),
        rebalanced=False,
        pending_result=None,
        expert_load_pass=torch.zeros(1, len(PLACEMENT), dtype=torch.int64),
        expert_load_window=torch.zeros(1, 1, len(PLACEMENT), dtype=torch.int64),
    )
    _commit_eplb_maps(state, p2l)
    return SimpleNamespace(
        model_states={hash_config_cached(model_config): state},
        ft_reset_epoch=0,
        expert_rearrangement_step=0,
        expert_load_window_step=0,
    )


def _physical(logical: torch.Tensor, state: Any) -> torch.Tensor:
    """vLLM's replica pick (``eplb_map_and_record``) of each (token, k)."""
    l2p, count = state.logical_to_physical_map[0], state.logical_replica_count[0]
    token = torch.arange(logical.shape[0], dtype=torch.int64)[:, None].expand_as(logical)
    hashed = (token * KNUTH_MULTIPLIER) & 0xFFFFFFFF
    ids = logical.to(torch.int64)
    physical: torch.Tensor = l2p[ids, hashed % count[ids]].to(torch.int32)
    return physical


def _step(manager: Any, state: Any, rank: int, world: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    logical = torch.rand(TOKENS, LOGICAL, generator=g).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    weights = torch.tensor([[0.5, 0.25]]).expand(TOKENS, TOP_K).contiguous()
    physical = _physical(logical, state)
    x = token_values(torch.arange(TOKENS) + rank * TOKENS, HIDDEN)
    communication = manager.get_communication()
    received = communication.dispatch(
        x, physical, weights, runtime_max_tokens_per_rank=TOKENS
    )  # vLLM 0.34's prepare: its keyword
    p2l = state.physical_to_logical_map[0]
    ids = received.topk_ids.to(torch.int64)
    mine = (ids >= rank * SLOTS_PER_RANK) & (ids < (rank + 1) * SLOTS_PER_RANK)
    scale = (p2l[ids.clamp(min=0)] + 1).to(torch.float32)
    factor = (received.topk_weights * scale * mine.float()).sum(dim=-1, keepdim=True)
    buffer = communication.get_combine_input_buffer(torch.bfloat16)  # vLLM 0.34's output buffer
    buffer.copy_((received.hidden_states.float() * factor).to(torch.bfloat16))
    output = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
    communication.combine(buffer, output=output)
    full = x.float() * (weights * (logical.to(torch.float32) + 1)).sum(dim=-1, keepdim=True)
    return {
        "seed": seed,
        "error": float((output.float() - full).abs().max()),
        "slots": sorted({int(s) for s in physical.flatten()}),
    }


def _wait_fault() -> None:
    from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager

    deadline = time.monotonic() + FAULT_WAIT_S
    while time.monotonic() < deadline:
        if get_ep_all2all_manager().query_fault().to("cpu", non_blocking=True).item():
            break
        time.sleep(0.02)  # one step's worth: the poll interval of a wait with a deadline
    manager = get_ep_all2all_manager()
    _say("fault", fault=bool(manager.query_fault()), mask=manager.query_active_mask().tolist())


def _worker(vllm_config: Any, runner: Any, index: int, size: int) -> Any:
    """What vLLM 0.34's ``WorkerSentinel`` reads of its worker (``gpu_worker_sentinel.py``)."""
    parallel = vllm_config.parallel_config
    return SimpleNamespace(
        vllm_config=vllm_config,
        parallel_config=SimpleNamespace(
            data_parallel_rank=index,
            data_parallel_size=size,
            data_parallel_master_ip="127.0.0.1",
            all2all_backend=parallel.all2all_backend,
            world_size=1,
            tensor_parallel_size=1,
            prefill_context_parallel_size=1,
            enable_eplb=True,
            eplb_config=SimpleNamespace(num_redundant_experts=REDUNDANT),
            cpu_distributed_timeout=timedelta(seconds=60),
        ),
        rank=0,
        model_runner=runner,
    )


def _scale_down(vllm_config: Any, runner: Any, index: int, size: int, port: int, key: str) -> None:
    from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager
    from vllm.v1.fault_tolerance.utils import FaultToleranceRequest
    from vllm.v1.worker.sentinel.gpu_worker_sentinel import WorkerSentinel

    # What EngineCoreSentinel puts in a worker's request (engine_core_sentinel.py).
    params = {
        "dead_dp_ranks": [3],
        "dp_master_ip": "127.0.0.1",
        "dp_group_rank": index,
        "dp_group_size": size,
        "recovery_round": key,
        "recovery_store_port": port,
    }
    started = time.monotonic()
    try:
        sentinel = WorkerSentinel(worker=_worker(vllm_config, runner, index, size))
        sentinel.handle_command(FaultToleranceRequest("scale_down", params, request_id=key))
    except Exception as error:
        _say("raised", **failure_report(error))
        return
    from vllm.distributed import get_dp_group

    manager = get_ep_all2all_manager()
    view = manager.adopted_view
    state = next(iter(runner.eplb_state.model_states.values()))
    _say(
        "scaled",
        seconds=time.monotonic() - started,
        view=None if view is None else [view.number, list(view.members)],
        fault=bool(manager.query_fault()),
        mask=manager.query_active_mask().tolist(),
        dp_group_size=get_dp_group().cpu_group.size(),
        placement=state.physical_to_logical_map[0].tolist(),
        suppressed=runner.eep_eplb_suppressed,
    )


def _built(vllm_config: Any, group: str) -> Any:
    """The manager, constructed and placed as vLLM's CudaCommunicator does, one layer built."""
    import vllm.distributed.device_communicators.all2all as a2a
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import get_ep_group

    os.environ["MOE_SIDECAR_GROUP"] = group
    ep = get_ep_group()
    with set_current_vllm_config(vllm_config):
        manager = a2a.FlashInferNVLinkOneSidedManager(ep.cpu_group)
    assert ep.device_communicator is not None
    ep.device_communicator.all2all_manager = manager
    # vLLM 0.34's call site for a bf16 layer: physical experts, the manager's initialize().
    manager.initialize(
        TOKENS, TOP_K, len(PLACEMENT), HIDDEN, dispatch_format=None, layer="model.layers.0.mlp"
    )
    return manager


def main(rank: int, world: int, init_method: str, group: str) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    os.environ["MOE_SIDECAR_BACKEND"] = "reference"
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    from vllm.plugins import load_general_plugins

    from moe_sidecar.client.engines.vllm.fault_tolerance import FT_BACKEND
    from tests.vllm.workers import _init_dp_environment

    load_general_plugins()  # what WorkerWrapperBase.init_worker does first
    vllm_config = _init_dp_environment(world, rank, 0, world, int(os.environ["FT_DP_PORT"]))
    vllm_config.parallel_config.enable_fault_tolerance = True
    vllm_config.parallel_config.all2all_backend = FT_BACKEND
    manager = _built(vllm_config, group)
    model_config = _ModelConfig()
    runner = SimpleNamespace(
        execute_model_state=None,
        req_states=SimpleNamespace(req_id_to_index={}),
        _remove_request=lambda req_id: None,
        model_config=model_config,
        eplb_state=_eplb_state(model_config),
        eep_eplb_suppressed=False,
        model=None,
    )
    state = next(iter(runner.eplb_state.model_states.values()))
    torch.accelerator.synchronize = lambda *args, **kwargs: None  # CPU: no accelerator
    _say("ready", support=manager.support_fault_tolerance)
    from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager

    for line in sys.stdin:
        command, *rest = line.split()
        if command == "steps":
            first, count = int(rest[0]), int(rest[1])
            ours = get_ep_all2all_manager()
            steps = [_step(ours, state, rank, world, seed) for seed in range(first, first + count)]
            _say("stepped", steps=steps)
        elif command == "fault":
            _wait_fault()
        elif command == "scale_down":
            index, size, port = int(rest[0]), int(rest[1]), int(rest[2])
            _scale_down(vllm_config, runner, index, size, port, rest[3])
        elif command == "update_mask":
            try:
                manager.update_mask(int(rest[0]), masked=True)
                _say("masked")
            except Exception as error:
                _say("raised", **failure_report(error))
        elif command == "cleanup":
            manager.cleanup()
            _say("cleaned")
            break
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: a peer is gone


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
