"""One rank of the sidecar-fault tests: ``python -m tests.multiprocess.sidecar_fault_rank
RANK WORLD INIT_METHOD GROUP``, with ``MOE_SIDECAR_TARGET`` (and perhaps
``MOE_SIDECAR_STALL_BUDGET``) in its environment.

As :mod:`tests.multiprocess.peer_loss_rank` (a gloo group, one layer built
through a real sidecar on the reference backend, ``ready``, then commands),
with one command more:

* ``grow PID``: ``initialize()`` of a bf16 layer, which grows the workspace:
  a round, a build and a commit. Every rank's build first waits in a
  barrier (so every rank holds its decision: a sidecar stopped while it is
  still sending the round's answers would stall the round, not the
  commits), then rank 0 stops process ``PID`` (the sidecar) with SIGSTOP, so
  every rank's commit meets a stalled sidecar (the test resumes it).
  ``grown`` with the generation, or ``raised`` with the error.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from moe_sidecar.client.backends import BuildSpec
from moe_sidecar.client.backends.reference import ReferenceAlltoAll, ReferenceBackend
from tests.multiprocess.peer_loss_rank import _say, answer_common
from tests.multiprocess.workers import bf16_layer, failure_report, initialize, nvfp4_layer


class StallingBackend(ReferenceBackend):
    """The reference backend; the build after :meth:`stall_at_next_build`
    waits for every rank's, then stops the sidecar (on the rank given a pid)."""

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self._cpu_group = group
        self._armed = False
        self._stop_pid: int | None = None

    def stall_at_next_build(self, pid: int | None) -> None:
        self._armed, self._stop_pid = True, pid

    def build(self, spec: BuildSpec) -> ReferenceAlltoAll:
        armed, pid = self._armed, self._stop_pid
        self._armed, self._stop_pid = False, None
        if armed:
            dist.barrier(group=self._cpu_group)
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)
        return super().build(spec)


def main(rank: int, world: int, init_method: str, group: str) -> None:
    from moe_sidecar.client import WorkspaceManager

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    cpu_group = dist.new_group(backend="gloo")
    backend = StallingBackend(cpu_group)
    manager = WorkspaceManager(
        cpu_group,
        group=group,
        target=os.environ["MOE_SIDECAR_TARGET"],
        backend=backend,
        local_ranks=world,
    )
    initialize(manager, nvfp4_layer("model.layers.0.mlp"))
    _say("ready", generation=manager.generation)
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "grow":
            backend.stall_at_next_build(int(rest[0]) if rank == 0 else None)
            try:
                initialize(manager, bf16_layer("mtp.mlp"))
            except Exception as error:
                _say("raised", **failure_report(error))
            else:
                _say("grown", generation=manager.generation)
        elif not answer_common(manager, command):
            break
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: peers may be gone


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
