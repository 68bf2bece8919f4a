"""One rank of the peer-loss tests: ``python -m tests.multiprocess.peer_loss_rank
RANK WORLD INIT_METHOD GROUP``, with ``MOE_SIDECAR_TARGET`` and
``MOE_SIDECAR_ON_PEER_LOSS`` in its environment.

It joins a gloo group, builds one layer through a real sidecar on the
reference backend, prints ``{"event": "ready", ...}`` and then runs the
commands it reads, one a line, printing one JSON line per answer (times on
CLOCK_MONOTONIC, which the test's process shares):

* ``block``: the main thread blocks (a long sleep, standing in for a CUDA
  wait): only the watcher can end the process now;
* ``group R...``: makes a gloo group of ranks ``R...`` (every rank runs it);
* ``barrier``: blocks in a barrier of that group, which a member sent
  ``block`` never enters: a collective waiting for a peer that never
  comes, as a combine does;
* ``call``: one call into the manager (``moe_alltoall``): ``called`` or
  ``raised`` with the error;
* ``cleanup``: ``cleanup()`` and a clean exit (status 0).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tests.multiprocess.workers import failure_report, initialize, nvfp4_layer, reference_manager

BLOCK_S = 600.0
"""Longer than any test: a blocked rank ends only by its watcher (or the test's kill)."""


def _say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}), flush=True)


def answer_common(manager: Any, command: str) -> bool:
    """Answers the commands every rank module takes (``block``, ``call``,
    ``cleanup``); False once the rank is to end (after ``cleanup``).

    Raises:
        ValueError: an unknown command (a test's mistake).
    """
    if command == "block":
        _say("blocking")
        time.sleep(BLOCK_S)
    elif command == "call":
        try:
            manager.moe_alltoall  # noqa: B018 (the call into the manager is the point)
        except Exception as error:
            _say("raised", **failure_report(error))
        else:
            _say("called")
    elif command == "cleanup":
        manager.cleanup()
        _say("cleaned")
        return False
    else:
        raise ValueError(f"unknown command {command!r}")
    return True


def main(rank: int, world: int, init_method: str, group: str) -> None:
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    cpu_group = dist.new_group(backend="gloo")
    manager = reference_manager(
        cpu_group, group, os.environ["MOE_SIDECAR_TARGET"], local_ranks=world
    )
    initialize(manager, nvfp4_layer("model.layers.0.mlp"))
    _say("ready", generation=manager.generation)
    subgroup: Any = None
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "group":
            subgroup = dist.new_group([int(r) for r in rest], backend="gloo")
            _say("grouped")
        elif command == "barrier":
            _say("blocking")
            dist.barrier(subgroup)
        elif not answer_common(manager, command):
            break
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: peers may be gone


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
