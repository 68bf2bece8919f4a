"""What a :class:`~moe_sidecar.client.manager.AlltoAllManager` settles once,
at construction: its backend and how many ranks of its EP group share its
decider, where that is stated."""

from __future__ import annotations

import os

import torch.distributed as dist

from moe_sidecar.client.backends import AlltoAllBackend, backend_for
from moe_sidecar.client.errors import InvalidArgument
from moe_sidecar.core.defaults import ENV_BACKEND, ENV_LOCAL_RANKS

__all__ = ["backend_named", "stated_local_ranks"]


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


def stated_local_ranks(explicit: int | None, ep_size: int) -> int | None:
    """How many ranks of the EP group run on this node, where it is stated:
    ``explicit``, else ``MOE_SIDECAR_LOCAL_RANKS``; None when neither states
    it (the ranks then count it in their lifetime's first exchange, bounded by
    the sidecar's round timeout: :mod:`moe_sidecar.client.first_round`).

    Raises:
        InvalidArgument: ``MOE_SIDECAR_LOCAL_RANKS`` is not an integer, or the
            count is outside ``[1, ep_size]``.
    """
    if explicit is None:
        env = os.environ.get(ENV_LOCAL_RANKS, "").strip()
        if not env:
            return None
        try:
            explicit = int(env)
        except ValueError as error:
            raise InvalidArgument.of(ENV_LOCAL_RANKS, env, "must be an integer") from error
    if not 1 <= explicit <= ep_size:
        raise InvalidArgument.of("local_ranks", explicit, f"must be in [1, ep_size={ep_size}]")
    return explicit
