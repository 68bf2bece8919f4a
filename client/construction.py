"""What a :class:`~moe_sidecar.client.manager.AlltoAllManager` settles once,
at construction: its backend and how many ranks of its EP group share its
decider."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from moe_sidecar.client.backends import AlltoAllBackend, backend_for
from moe_sidecar.client.errors import InvalidArgument
from moe_sidecar.core.defaults import ENV_BACKEND, ENV_LOCAL_RANKS

__all__ = ["backend_named", "local_ranks_of"]


def backend_named(
    backend: str | AlltoAllBackend | None, cpu_group: dist.ProcessGroup
) -> AlltoAllBackend:
    """The backend ``backend`` names (None: ``MOE_SIDECAR_BACKEND``, else
    ``"flashinfer"``), on ``cpu_group``; an object is taken as it is.

    Raises:
        InvalidArgument: an unknown name read from ``MOE_SIDECAR_BACKEND``.
        ValueError: an unknown name passed as ``backend``.
    """
    if backend is None:
        name = os.environ.get(ENV_BACKEND, "").strip() or "flashinfer"
        try:
            return backend_for(name, cpu_group)
        except ValueError as error:
            raise InvalidArgument.of(ENV_BACKEND, name, str(error)) from error
    if isinstance(backend, str):
        return backend_for(backend, cpu_group)
    return backend


def local_ranks_of(
    explicit: int | None, cpu_group: dist.ProcessGroup, ep_size: int, ep_rank: int
) -> tuple[int, int]:
    """How many ranks of the EP group run on this node, and how many
    collectives finding it took: ``explicit``, else ``MOE_SIDECAR_LOCAL_RANKS``,
    else counted by exchanging hostnames on ``cpu_group`` (one collective).

    Raises:
        InvalidArgument: ``MOE_SIDECAR_LOCAL_RANKS`` is not an integer, or the
            count is outside ``[1, ep_size]``.
    """
    exchanges = 0
    if explicit is None:
        env = os.environ.get(ENV_LOCAL_RANKS, "").strip()
        if env:
            try:
                explicit = int(env)
            except ValueError as error:
                raise InvalidArgument.of(ENV_LOCAL_RANKS, env, "must be an integer") from error
    if explicit is None:
        hosts: list[object] = [None] * ep_size
        dist.all_gather_object(hosts, socket.gethostname(), group=cpu_group)
        exchanges += 1
        explicit = hosts.count(hosts[ep_rank])
    if not 1 <= explicit <= ep_size:
        raise InvalidArgument.of("local_ranks", explicit, f"must be in [1, ep_size={ep_size}]")
    return explicit, exchanges
