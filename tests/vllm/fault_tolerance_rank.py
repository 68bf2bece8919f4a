"""One rank of ``test_fault_tolerance.py``: ``python -m tests.vllm.fault_tolerance_rank
RANK WORLD INIT_METHOD GROUP``, with ``MOE_SIDECAR_TARGET``,
``MOE_SIDECAR_ON_PEER_LOSS=mask`` and ``FT_DP_PORT`` in its environment.

It joins a gloo world, loads the plugins with vLLM's own
``load_general_plugins()``, builds vLLM's process groups (DP = WORLD, tp = pp
= 1: ``tests.vllm.workers._init_dp_environment``) under a config with
``enable_fault_tolerance`` and ``all2all_backend="flashinfer_nvlink_one_sided"``,
constructs the manager as vLLM's ``CudaCommunicator`` does
(``FlashInferNVLinkOneSidedManager(cpu_group)``, the plugin's class) and puts
it where ``get_ep_all2all_manager()`` finds it, builds one layer (the
reference backend, through the sidecar), prints ``ready`` and runs the
commands it reads, one a line:

* ``steps FIRST COUNT``: exact steps through what ``get_ep_all2all_manager()``
  returns (``tests.multiprocess.masked_view_rank``'s steps): ``stepped``;
* ``fault``: what vLLM's model runner does after each step until it reads a
  fault (at most 30 s): ``query_fault()`` copied ``.to("cpu",
  non_blocking=True)`` and read with ``.item()``, then ``query_active_mask()``:
  ``fault``;
* ``retry INDEX SIZE PORT``: vLLM's own ``WorkerSentinel`` for this worker
  (DP rank INDEX of SIZE survivors), its ``handle_command`` of a real
  ``FaultToleranceRequest("retry", {"new_stateless_dp_group_ports": [PORT]})``:
  ``retried`` with what the manager says afterwards, or ``raised``;
* ``cleanup``: ``cleanup()`` and a clean exit.

The sentinel's ``worker`` is a stand-in holding what ``WorkerSentinel`` reads
(its parallel settings, an empty model runner, the real ``VllmConfig``): vLLM's
GPU worker cannot be built on a CPU machine. ``torch.accelerator.synchronize``
is a no-op here (the retry's first line; CPU has no accelerator).
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

from tests.multiprocess.masked_view_rank import _step
from tests.multiprocess.masked_workers import HIDDEN, NUM_EXPERTS, TOKENS, TOP_K
from tests.multiprocess.workers import failure_report

WATCHDOG_S = 560.0
"""Longer than the test's own timeout: only a hung rank meets it."""
FAULT_WAIT_S = 30.0


def _say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}), flush=True)


def _hooks(manager: Any) -> dict[str, Any]:
    """What vLLM's model runner reads of the manager, as plain data."""
    fault = manager.query_fault()
    mask = manager.query_active_mask()
    return {
        "fault": bool(fault.to("cpu", non_blocking=True).item()),
        "fault_tensor": [str(fault.dtype), list(fault.shape), fault.device.type],
        "mask": mask.tolist(),
        "mask_tensor": [str(mask.dtype), list(mask.shape), mask.device.type],
        "active_mask": manager.active_mask(),
    }


def _wait_fault() -> None:
    """vLLM's check after a step (gpu_model_runner.py: AsyncGPUModelRunnerOutput)."""
    from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager

    deadline = time.monotonic() + FAULT_WAIT_S
    while time.monotonic() < deadline:
        has_fault = get_ep_all2all_manager().query_fault()
        if has_fault.to("cpu", non_blocking=True).item():
            break
        time.sleep(0.02)  # one step's worth: the poll interval of a wait with a deadline
    _say("fault", **_hooks(get_ep_all2all_manager()))


def _retry(vllm_config: Any, index: int, size: int, port: int) -> None:
    from vllm.distributed import get_dp_group
    from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager
    from vllm.v1.fault_tolerance.utils import FaultToleranceRequest
    from vllm.v1.worker.sentinel.gpu_worker_sentinel import WorkerSentinel

    parallel = vllm_config.parallel_config
    worker = SimpleNamespace(
        vllm_config=vllm_config,
        parallel_config=SimpleNamespace(
            data_parallel_rank=index,
            data_parallel_size=size,
            data_parallel_master_ip="127.0.0.1",
            all2all_backend=parallel.all2all_backend,
            world_size=1,
            cpu_distributed_timeout=timedelta(seconds=60),
        ),
        rank=0,
        use_v2_model_runner=True,
        model_runner=SimpleNamespace(
            execute_model_state=None,
            req_states=SimpleNamespace(req_id_to_index={}),
            _remove_request=lambda req_id: None,
        ),
    )
    try:
        sentinel = WorkerSentinel(worker=worker)
        request = FaultToleranceRequest("retry", {"new_stateless_dp_group_ports": [port]})
        sentinel.handle_command(request)
    except Exception as error:
        _say("raised", **failure_report(error))
        return
    manager = get_ep_all2all_manager()
    view = manager._views.adopted
    _say(
        "retried",
        view=None if view is None else [view.number, list(view.members)],
        dp_group_size=get_dp_group().cpu_group.size(),
        **_hooks(manager),
    )


def _built(vllm_config: Any, group: str) -> Any:
    """The manager, constructed and placed as vLLM's CudaCommunicator does, one layer built."""
    import vllm.distributed.device_communicators.all2all as a2a
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import get_ep_group

    from moe_sidecar.client.layer_need import LayerNeed, Layout
    from moe_sidecar.client.sizing import layer_capacities

    os.environ["MOE_SIDECAR_GROUP"] = group
    ep = get_ep_group()
    with set_current_vllm_config(vllm_config):
        manager = a2a.FlashInferNVLinkOneSidedManager(ep.cpu_group)
    # cuda_communicator.py: self.all2all_manager = FlashInferNVLinkOneSidedManager(...);
    # on a CPU platform vLLM builds a DeviceCommunicatorBase, whose manager is None.
    assert ep.device_communicator is not None
    ep.device_communicator.all2all_manager = manager
    world = manager.ep_size
    capacities = layer_capacities(world, TOKENS, TOP_K, NUM_EXPERTS, HIDDEN, 2 * HIDDEN, 0)
    need = LayerNeed(capacities, Layout(HIDDEN, None, None, 2 * HIDDEN, 0), "model.layers.0.mlp")
    manager.initialize_layer(need)
    return manager


def main(rank: int, world: int, init_method: str, group: str) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    os.environ["MOE_SIDECAR_BACKEND"] = "reference"
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager
    from vllm.plugins import load_general_plugins

    from moe_sidecar.client.engines.vllm.fault_tolerance import FT_BACKEND
    from tests.vllm.workers import _init_dp_environment

    load_general_plugins()  # what WorkerWrapperBase.init_worker does first
    vllm_config = _init_dp_environment(world, rank, 0, world, int(os.environ["FT_DP_PORT"]))
    vllm_config.parallel_config.enable_fault_tolerance = True
    vllm_config.parallel_config.all2all_backend = FT_BACKEND
    manager = _built(vllm_config, group)
    import vllm.v1.worker.sentinel.gpu_worker_sentinel as sentinel_module

    torch.accelerator.synchronize = lambda *args, **kwargs: None  # CPU: see above
    _say(
        "ready",
        cls=type(manager).__name__,
        support=manager.support_fault_tolerance,
        ft_backends=sorted(sentinel_module.FT_BACKEND_SET),
        **_hooks(manager),
    )
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "steps":
            first, count = int(rest[0]), int(rest[1])
            ours = get_ep_all2all_manager()
            steps = [_step(ours, rank, world, seed) for seed in range(first, first + count)]
            _say("stepped", steps=steps)
        elif command == "fault":
            _wait_fault()
        elif command == "retry":
            _retry(vllm_config, int(rest[0]), int(rest[1]), int(rest[2]))
        elif command == "cleanup":
            manager.cleanup()
            _say("cleaned")
            break
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: a peer is gone


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
