"""A rank with no coordination at all: the baseline the benchmarks compare against.

What vLLM's in-process fix does: size each layer with the same rule as the
manager (:func:`moe_sidecar.client.engines.vllm.sizing.classify_call`), grow to the
union this rank has seen, build through the same backend and pass the EP
barrier; no proposal, no agreement, no history. Its ``initialize()`` takes
the manager's arguments, so a benchmark runs the same layers through both.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from moe_sidecar.client.backends import AlltoAll, BuildSpec, backend_for
from moe_sidecar.client.engines.vllm.sizing import KEYWORDS, classify_call
from moe_sidecar.core.plan import Capacities, join_capacities

__all__ = ["UncoordinatedRank"]

_KEYWORD_NAMES = frozenset(name for pair in KEYWORDS.values() for name in pair)


class UncoordinatedRank:
    """Builds the union of the layers seen on this rank, alone.

    Args:
        cpu_group: the EP group's CPU (gloo) process group (the backend's and
            the barrier's).
        backend: a backend name of :func:`moe_sidecar.client.backends.backend_for`.

    Raises:
        ValueError: an unknown backend name.
    """

    def __init__(self, cpu_group: dist.ProcessGroup, backend: str = "reference") -> None:
        self.cpu_group = cpu_group
        self.ep_size = dist.get_world_size(cpu_group)
        self.ep_rank = dist.get_rank(cpu_group)
        self.backend = backend_for(backend, cpu_group)
        self.capacities: Capacities | None = None
        self.alltoall: AlltoAll | None = None
        self.builds = 0

    def initialize(
        self,
        max_num_tokens: int,
        top_k: int,
        num_experts: int,
        hidden_size: int,
        *payload: object,
        layer: str = "",
        **keywords: Any,
    ) -> None:
        """Serves this layer: builds only when the union grows.

        Raises:
            InvalidArgument: the call is not one any vLLM generation makes.
        """
        call = classify_call(
            self.ep_size,
            max_num_tokens,
            top_k,
            num_experts,
            hidden_size,
            payload,
            {k: v for k, v in keywords.items() if k in _KEYWORD_NAMES},
        )
        if self.capacities is not None and self.capacities.covers(call.capacities):
            return
        need = (
            call.capacities
            if self.capacities is None
            else join_capacities(self.capacities, call.capacities)
        )
        spec = BuildSpec(
            self.ep_size, self.ep_rank, need, self.backend.workspace_bytes(need, self.ep_size)
        )
        handle = self.backend.build(spec)
        dist.barrier(group=self.cpu_group)
        if self.alltoall is not None:
            self.backend.release(self.alltoall)
        self.alltoall, self.capacities = handle, need
        self.builds += 1

    def cleanup(self) -> None:
        """Releases what was built."""
        if self.alltoall is not None:
            self.backend.release(self.alltoall)
        self.alltoall, self.capacities = None, None
