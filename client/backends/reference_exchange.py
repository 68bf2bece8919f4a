"""The reference all-to-all's one exchange: rows to peers over gloo, masked peers left out.

FlashInfer's one-sided NVLink writes become, on the CPU, either one
``all_to_all_single`` over the whole EP group (every rank a member) or
point-to-point sends and receives between the members only (a membership
mask without some ranks): a masked rank takes no part at all, as FlashInfer's
kernels neither write to it nor wait for its flags.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["exchange_rows"]


def exchange_rows(
    group: dist.ProcessGroup,
    received: torch.Tensor,
    sent: torch.Tensor,
    *,
    rank: int,
    members: tuple[int, ...] | None,
) -> None:
    """Row ``r`` of ``sent`` goes to group rank ``r``; row ``r`` of ``received``
    comes from it. Both are contiguous, with ``ep_size`` equal rows along the
    first dimension (a 1-D tensor is split into ``ep_size`` equal parts).

    ``members`` None: every rank takes part (one ``all_to_all_single``).
    Otherwise only the ranks listed (``rank`` among them) exchange; the rows
    of ``received`` from the others are zeroed.
    """
    if members is None:
        dist.all_to_all_single(received, sent, group=group)
        return
    ep_size = dist.get_world_size(group)
    into = received.view(ep_size, -1)
    out_of = sent.contiguous().view(ep_size, -1)
    pending: list[dist.Work] = []
    for peer in members:
        if peer == rank:
            into[peer].copy_(out_of[peer])
            continue
        for work in (
            dist.isend(out_of[peer], group=group, group_dst=peer),
            dist.irecv(into[peer], group=group, group_src=peer),
        ):
            if work is not None:
                pending.append(work)
    for work in pending:
        work.wait()
    for peer in range(ep_size):
        if peer not in members:
            into[peer].zero_()
