"""One rank of ``test_masked_view.py``: ``python -m tests.multiprocess.masked_view_rank
RANK WORLD INIT_METHOD GROUP``, with ``MOE_SIDECAR_TARGET`` and
``MOE_SIDECAR_ON_PEER_LOSS=mask`` in its environment.

It joins a gloo group, builds one layer (``masked_workers``' shapes) through
a real sidecar with ``AlltoAllManager`` on the reference backend, prints
``{"event": "ready", ...}`` and then runs the commands it reads, one a line,
printing one JSON line per answer:

* ``steps FIRST COUNT``: steps with seeds ``FIRST..FIRST+COUNT-1``, each one
  dispatch + expert compute + combine through what the manager hands out
  (even seeds ``moe_alltoall``, odd ones ``get_communication()``), no mask
  passed by the caller: ``stepped`` with every step's combined rows, its
  rows received per source, and the manager's mask;
* ``fault``: waits (at most 30 s) until ``peer_fault()``: ``fault``;
* ``adopt``: ``adopt_view()``: ``adopted`` with the view, or ``raised``;
* ``rejoin INIT_METHOD``: a survivor re-forms the gloo group with a
  replacement (the broken one destroyed, a new one on ``INIT_METHOD``) and
  calls ``rejoin()``: ``adopted`` with the join view, or ``raised``;
* ``layer NAME TOKENS``: ``initialize_layer`` of one more layer of the same
  shape at ``TOKENS`` tokens per rank: ``initialized`` with the generation;
* ``cleanup``: ``cleanup()`` and a clean exit.

With a fifth argument ``INIT_METHOD`` the process is a replacement for rank
``RANK``: it joins the gloo group on it, makes its manager and calls
``join_as_replacement`` with the same layer, printing ``adopted`` (or
``raised``) instead of ``ready``, then runs the same commands; a sixth,
``TOKENS``, is the tokens per rank of the layer it joins with (default
the others' layer's).

A watchdog (``faulthandler``) dumps every thread's stack to stderr and ends
the process past :data:`WATCHDOG_S`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.multiprocess.masked_workers import (
    HIDDEN,
    INVALID_EXPERT,
    NUM_EXPERTS,
    TOKENS,
    TOP_K,
    expert_scale,
    owner,
    step_inputs,
)
from tests.multiprocess.workers import failure_report

WATCHDOG_S = 280.0
"""Longer than the test's own timeout: only a hung rank meets it."""
FAULT_WAIT_S = 30.0


def _say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}), flush=True)


def _expert_out(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, rank: int, world: int
) -> torch.Tensor:
    """This rank's experts applied to the rows it received (``e % 3 + 1`` times the row)."""
    owners = torch.tensor([owner(e, world) for e in range(NUM_EXPERTS)])
    safe = ids.clamp(min=0).long()
    mine = ((ids >= 0) & (owners[safe] == rank)).to(torch.float32)
    factor = (weights * expert_scale(safe) * mine).sum(dim=-1, keepdim=True)
    return (x.to(torch.float32) * factor).to(torch.bfloat16)


def _step(manager: Any, rank: int, world: int, seed: int) -> dict[str, Any]:
    """One step through the manager's objects; the caller passes no mask."""
    inputs = step_inputs(rank, seed)
    values, ids, weights = inputs["values"].to(torch.bfloat16), inputs["ids"], inputs["weights"]
    if seed % 2 == 0:
        a2a = manager.moe_alltoall
        x, recv_ids, recv_weights = a2a.dispatch(
            ids, [values, ids, weights], TOKENS, INVALID_EXPERT, 1
        )
        combined = a2a.combine(_expert_out(x, recv_ids, recv_weights, rank, world), TOKENS)
        received = (recv_ids != INVALID_EXPERT).all(dim=-1).sum(dim=-1).tolist()
    else:
        communication = manager.get_communication()
        result = communication.dispatch(values, ids, weights, max_tokens_per_rank=TOKENS)
        out = _expert_out(result.hidden_states, result.topk_ids, result.topk_weights, rank, world)
        combined = communication.combine(out)
        rows = result.topk_ids.view(world, TOKENS, TOP_K)
        received = (rows != INVALID_EXPERT).all(dim=-1).sum(dim=-1).tolist()
    return {
        "seed": seed,
        "combined": combined.to(torch.float32).tolist(),
        "received": received,
        "active_mask": manager.active_mask(),
    }


def _wait_fault(manager: Any) -> None:
    deadline = time.monotonic() + FAULT_WAIT_S
    while not manager.peer_fault() and time.monotonic() < deadline:
        time.sleep(0.02)  # the poll interval of a wait with a deadline
    _say("fault", fault=manager.peer_fault())


def _adopt(manager: Any, adopt: Any = None) -> None:
    try:
        view = adopt() if adopt is not None else manager.adopt_view(timeout_s=60.0)
    except Exception as error:
        traceback.print_exc()  # the stack, in the rank's stderr file
        _say("raised", **failure_report(error))
        return
    _say(
        "adopted",
        number=view.number,
        members=list(view.members),
        mask=view.mask,
        active_mask=manager.active_mask(),
        fault=manager.peer_fault(),
        generation=manager.generation,
    )


def _cpu_group(rank: int, world: int, init_method: str) -> Any:
    """A gloo group of every rank, on ``init_method``."""
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    return dist.new_group(backend="gloo")


def _need(world: int, name: str, tokens: int) -> Any:
    from moe_sidecar.client.layer_need import LayerNeed, Layout
    from moe_sidecar.client.sizing import layer_capacities

    capacities = layer_capacities(world, tokens, TOP_K, NUM_EXPERTS, HIDDEN, 2 * HIDDEN, 0)
    return LayerNeed(capacities, Layout(HIDDEN, None, None, 2 * HIDDEN, 0), name)


def _rejoin(manager: Any, rank: int, world: int, init_method: str) -> None:
    """The group with the dead rank is destroyed and one with the replacement formed."""
    dist.destroy_process_group()
    cpu_group = _cpu_group(rank, world, init_method)
    _adopt(manager, lambda: manager.rejoin(cpu_group, timeout_s=60.0))


def _layer(manager: Any, world: int, name: str, tokens: int) -> None:
    try:
        manager.initialize_layer(_need(world, name, tokens))
    except Exception as error:
        _say("raised", **failure_report(error))
        return
    _say("initialized", generation=manager.generation, counters=str(manager.counters))


def main(
    rank: int, world: int, init_method: str, group: str, joins: str | None, tokens: int
) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    from moe_sidecar.client.manager import AlltoAllManager
    from moe_sidecar.client.rejoin import join_as_replacement

    manager = AlltoAllManager(
        _cpu_group(rank, world, joins or init_method),
        group=group,
        target=os.environ["MOE_SIDECAR_TARGET"],
        backend="reference",
        local_ranks=world,
    )
    need = _need(world, "model.layers.0.mlp", TOKENS)
    if joins is not None:
        wanted = _need(world, "model.layers.0.mlp", tokens)
        _adopt(manager, lambda: join_as_replacement(manager, wanted, timeout_s=60.0))
    else:
        manager.initialize_layer(need)
        _say("ready", generation=manager.generation, fault=manager.peer_fault())
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "rejoin":
            _rejoin(manager, rank, world, rest[0])
        elif command == "layer":
            _layer(manager, world, rest[0], int(rest[1]))
        elif command == "steps":
            first, count = int(rest[0]), int(rest[1])
            steps = [_step(manager, rank, world, seed) for seed in range(first, first + count)]
            _say("stepped", steps=steps)
        elif command == "fault":
            _wait_fault(manager)
        elif command == "adopt":
            _adopt(manager)
        elif command == "cleanup":
            manager.cleanup()
            _say("cleaned")
            break
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: a peer is gone


if __name__ == "__main__":
    main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        sys.argv[5] if len(sys.argv) > 5 else None,
        int(sys.argv[6]) if len(sys.argv) > 6 else TOKENS,
    )
