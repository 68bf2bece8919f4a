"""The typed error of a collective that failed because a peer of the EP group died."""

from __future__ import annotations

import time

from moe_sidecar.client.errors import CoordinatorError, RankLost
from moe_sidecar.client.transport import Transport
from moe_sidecar.core.group import RankSummary

__all__ = ["rank_lost"]

_GONE_WAIT_S = 2.0
"""How long a rank whose collective failed asks the sidecar who left (its
session's end reaches the sidecar within milliseconds of the process's death)."""


def rank_lost(
    transport: Transport, group: str, ep_rank: int, where: str, error: RuntimeError
) -> RankLost:
    """The typed error for a collective that failed because a peer died,
    naming the rank the sidecar saw leave (it may take a moment to see it)."""
    gone: list[RankSummary] = []
    deadline = time.monotonic() + _GONE_WAIT_S
    while not transport.embedded:
        try:
            gone = transport.gone_ranks(group)
        except CoordinatorError:
            break
        if gone or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if gone:
        who = "; ".join(
            f"rank {r.ep_rank} (last layer {r.last_layer or '(unnamed)'!r}) is gone: {r.left}"
            for r in gone
        )
    else:
        who = (
            "a rank left (in embedded mode no sidecar sees which)"
            if transport.embedded
            else "a rank left (the sidecar saw no session end)"
        )
    return RankLost(
        f"EP group {group!r}: {who}; {where} failed on rank {ep_rank} (gloo: "
        f"{error}); restart every rank",
        tuple(r.ep_rank for r in gone),
    )
