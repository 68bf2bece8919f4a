"""FlashInfer's ``CommBackend`` over one torch.distributed CPU group.

FlashInfer's MNNVL memory exchanges allocation sizes, hostnames and memory
handles (or file descriptors) through a communicator with an mpi4py-like
surface: ``Get_rank``, ``Get_size``, ``allgather``, ``bcast``, ``barrier``
and ``Split``. This one runs every collective on the EP group's gloo group
and nothing wider, so pipeline stages building a different number of times
never wait on each other.

``MoeAlltoAll`` calls ``Split(color, key)`` (in
``MnnvlMemory.set_comm_from_config``) with ``color = pp_rank * cp_size +
cp_rank`` and ``key = tp_rank`` of the mapping the client builds, where every
rank of the EP group has the same color. A split into one color needs no new
process group: the result is this group, with ranks renumbered by ``key``
when the keys reorder them. A split into several colors would need new
process groups created by every rank of the parent group, which is how a
world-wide group sneaks in; it is refused with a clear error instead.

This module does not import FlashInfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from moe_sidecar.client.errors import BackendError

__all__ = ["GroupCommunicator"]


class GroupCommunicator:
    """An mpi4py-style communicator over ``group`` (collectives on it only).

    Args:
        group: the EP group's CPU process group.
        order: the group ranks in communicator-rank order (None: the group's
            own order). ``Split`` sets it when keys reorder the ranks.
    """

    def __init__(self, group: dist.ProcessGroup, order: Sequence[int] | None = None) -> None:
        self._group = group
        size = dist.get_world_size(group)
        self._order: tuple[int, ...] = tuple(order) if order is not None else tuple(range(size))
        if sorted(self._order) != list(range(size)):
            raise BackendError(f"order {self._order} is not a permutation of 0..{size - 1}")
        self._group_rank = dist.get_rank(group)
        self._rank = self._order.index(self._group_rank)
        self.collectives = 0
        """Collectives issued on the group (for tests and diagnostics)."""

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group every collective runs on."""
        return self._group

    def Get_rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    def Get_size(self) -> int:
        """How many ranks the communicator has."""
        return len(self._order)

    def _gather_by_group_rank(self, data: Any) -> list[Any]:
        gathered: list[Any] = [None] * len(self._order)
        dist.all_gather_object(gathered, data, group=self._group)
        self.collectives += 1
        return gathered

    def allgather(self, data: Any) -> tuple[Any, ...]:
        """Every rank's ``data``, indexed by communicator rank."""
        by_group_rank = self._gather_by_group_rank(data)
        return tuple(by_group_rank[group_rank] for group_rank in self._order)

    def bcast(self, data: Any, root: int) -> Any:
        """``data`` of communicator rank ``root``, on every rank.

        Raises:
            BackendError: ``root`` is not a rank of the communicator.
        """
        if not 0 <= root < len(self._order):
            raise BackendError(f"bcast root {root} outside 0..{len(self._order) - 1}")
        objects = [data]
        source = dist.get_global_rank(self._group, self._order[root])
        dist.broadcast_object_list(objects, src=source, group=self._group)
        self.collectives += 1
        return objects[0]

    def barrier(self) -> None:
        """Waits for every rank of the group (and only of the group)."""
        dist.barrier(group=self._group)
        self.collectives += 1

    def Split(self, color: int, key: int) -> GroupCommunicator:
        """The sub-communicator of the ranks that pass the same ``color``.

        Collective over the group. Ranks of the result are ordered by
        ``(key, rank)`` as MPI orders them.

        Raises:
            BackendError: the ranks passed more than one color; the client
                builds its mapping so that they never do.
        """
        gathered = self.allgather((color, key))
        colors = sorted({c for c, _ in gathered})
        if len(colors) != 1:
            by_color = {c: [r for r, (cc, _) in enumerate(gathered) if cc == c] for c in colors}
            raise BackendError(
                f"Split into {len(colors)} colors {by_color} (color -> communicator ranks): this "
                "communicator spans one EP group and splits it only as a whole; a multi-color "
                "split would need process groups created across the parent group. Build the "
                "FlashInfer Mapping so that every rank of the EP group has the same "
                "pp_rank * cp_size + cp_rank"
            )
        new_order = [
            self._order[rank]
            for rank in sorted(range(len(gathered)), key=lambda r: (gathered[r][1], r))
        ]
        split = GroupCommunicator(self._group, new_order)
        split.collectives = self.collectives
        return split
