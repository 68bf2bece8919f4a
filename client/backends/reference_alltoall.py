"""A CPU all-to-all with FlashInfer ``MoeAlltoAll``'s contract, over gloo.

It exists so the workspace bug and its fix can be shown, and the manager
tested, on machines without GPUs. It is faithful where that matters:

* each rank owns a workspace byte buffer of exactly
  ``workspace_size_per_rank`` bytes, laid out with FlashInfer's offsets
  (:func:`moe_sidecar.client.sizing.aux_offsets`): counters, top-k target ranks and send
  indices, then one region per dispatch payload, then the combine region;
* dispatch sends each token once to every rank that owns one of its top-k
  experts (FlashInfer's contiguous ceil/floor expert-to-rank partition;
  duplicate targets within a token collapse to one send), and writes what a
  rank receives into that rank's payload regions; combine writes expert
  outputs into the source rank's combine region and sums them per token over
  its top-k in float32;
* it applies FlashInfer's two size checks with FlashInfer's words: the
  dispatch payloads must fit (``workspace size per rank insufficient, need X
  bytes but has Y``) and ``combinePayloadOffset + combine payload`` must not
  exceed the workspace (``workspace insufficient for combine payload
  region``), both as ``RuntimeError``;
* built with ``enable_rank_mask``, it takes an active-rank mask (an ``int``,
  bit i = rank i a member): a token's copy for a masked rank is not sent
  (target and send index -1, as for a duplicate), so combine leaves that
  rank's share out of the sum; masked ranks take no part.

The one-sided NVLink writes become ``all_to_all_single`` on the EP group's
gloo group (under a mask, sends and receives between its members:
:mod:`~moe_sidecar.client.backends.reference_exchange`). A released
workspace's memory is returned at once (its storage is shrunk to zero bytes,
so a stale view fails loudly rather than reading freed memory, as on a GPU); :func:`live_workspace_bytes` counts what is held.
``checkpoint_prepare``/``checkpoint_restore`` give the memory back and take it
again, as FlashInfer's unmap and remap do.

:class:`~moe_sidecar.client.backends.reference_moe_ep.ReferenceCommunication`
wraps it as FlashInfer's moe_ep communication object.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from moe_sidecar.client.backends.base import BuildSpec
from moe_sidecar.client.backends.rank_mask import (
    check_rank_mask,
    members,
    refuse_other_combine_mask,
)
from moe_sidecar.client.backends.reference_exchange import exchange_rows
from moe_sidecar.client.errors import BackendError
from moe_sidecar.client.sizing import KMAX_TOP_K, AuxOffsets, align, aux_offsets

__all__ = ["ReferenceAlltoAll", "expert_owner", "live_workspace_bytes"]

_live_lock = threading.Lock()
_live_bytes = 0


def live_workspace_bytes() -> int:
    """Bytes of reference workspaces allocated in this process and not released."""
    with _live_lock:
        return _live_bytes


def _account(delta: int) -> None:
    global _live_bytes
    with _live_lock:
        _live_bytes += delta


def expert_owner(expert_ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """The EP rank owning each expert id: FlashInfer's ceil/floor partition.

    With ``base = num_experts // ep_size`` and ``remainder = num_experts %
    ep_size``, ranks ``[0, remainder)`` own ``base + 1`` consecutive experts
    and the rest own ``base``.
    """
    base, remainder = divmod(num_experts, ep_size)
    ids = expert_ids.to(torch.int64)
    split = remainder * (base + 1)
    low = torch.div(ids, base + 1, rounding_mode="floor")
    high = remainder + torch.div(ids - split, base, rounding_mode="floor")
    return torch.where(ids < split, low, high)


@dataclass
class _Dispatched:
    local_num_tokens: int
    runtime_max_tokens_per_rank: int
    combine_payload_offset: int
    active_rank_mask: int | None
    """The dispatch's checked mask (None: built without ``enable_rank_mask``)."""


def _int32_region(buffer: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    return buffer[offset : offset + 4 * count].view(torch.int32)


class _CombineRegion(NamedTuple):
    """Where a combine's payload lands in the workspace, and its shape."""

    offset: int
    """The combine payload region's byte offset (behind the dispatch payloads)."""
    payload_bytes: int
    local_num_tokens: int
    """Tokens this rank dispatched: rows of the combined output."""
    hidden: int


class ReferenceAlltoAll:
    """One rank's end of the reference all-to-all; built collectively.

    Attributes mirror ``MoeAlltoAll``: ``workspace_size_per_rank``,
    ``max_num_tokens``, ``ep_size``, ``ep_rank``, ``top_k``, ``num_experts``,
    ``metainfo`` (the offsets), ``workspace`` (this rank's byte buffer).

    Raises:
        ValueError: sizes FlashInfer would refuse (num_experts < ep_size,
            top_k outside [1, 22], a workspace smaller than its auxiliary data).
        RuntimeError: ranks build with different sizes (FlashInfer asserts
            the same).
    """

    def __init__(self, group: dist.ProcessGroup, spec: BuildSpec) -> None:
        if spec.ep_size != dist.get_world_size(group) or spec.ep_rank != dist.get_rank(group):
            raise ValueError(
                f"spec says ep_rank {spec.ep_rank} of {spec.ep_size} but the group has rank "
                f"{dist.get_rank(group)} of {dist.get_world_size(group)}"
            )
        if not 0 < spec.top_k <= KMAX_TOP_K:
            raise ValueError(f"top_k={spec.top_k}: must be in [1, {KMAX_TOP_K}]")
        if spec.num_experts < spec.ep_size:
            raise ValueError(f"num_experts={spec.num_experts}: must be >= ep_size={spec.ep_size}")
        self.metainfo: AuxOffsets = aux_offsets(spec.ep_size, spec.max_num_tokens)
        if spec.workspace_size_per_rank < self.metainfo.payload_data:
            raise ValueError(
                f"workspace_size_per_rank={spec.workspace_size_per_rank} is smaller than its "
                f"auxiliary data ({self.metainfo.payload_data} bytes)"
            )
        self._group = group
        self.workspace_size_per_rank = spec.workspace_size_per_rank
        self.max_num_tokens = spec.max_num_tokens
        self.ep_size = spec.ep_size
        self.ep_rank = spec.ep_rank
        self.top_k = spec.top_k
        self.num_experts = spec.num_experts
        self.enable_rank_mask = spec.enable_rank_mask
        # FlashInfer's allocation gathers every rank's size and refuses a mismatch.
        mine = torch.tensor([spec.workspace_size_per_rank, spec.max_num_tokens], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(spec.ep_size)]
        dist.all_gather(everyone, mine, group=group)
        if any(not torch.equal(other, mine) for other in everyone):
            raise RuntimeError(
                "Not all rank allocating same size: (workspace bytes, max tokens) per rank = "
                f"{[tuple(t.tolist()) for t in everyone]}"
            )
        self._buffer: torch.Tensor | None = torch.zeros(
            spec.workspace_size_per_rank, dtype=torch.uint8
        )
        _account(spec.workspace_size_per_rank)
        self._released = False
        self._dispatched: _Dispatched | None = None
        self.eplb_gathered_stats: torch.Tensor | None = None
        """FlashInfer's attribute; EPLB statistics are not gathered here."""

    # --- state ---------------------------------------------------------

    @property
    def released(self) -> bool:
        """True once :meth:`release` returned the workspace."""
        return self._released

    @property
    def workspace(self) -> torch.Tensor:
        """This rank's workspace bytes.

        Raises:
            BackendError: after :meth:`release`.
            RuntimeError: between :meth:`checkpoint_prepare` and
                :meth:`checkpoint_restore` (FlashInfer's words).
        """
        if self._released:
            raise BackendError(
                f"reference all-to-all of {self.workspace_size_per_rank} bytes was released; "
                "use the manager's current moe_alltoall"
            )
        if self._buffer is None:
            raise RuntimeError("MNNVL handles are unmapped")
        return self._buffer

    def _free_buffer(self) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is None:
            return
        # Shrinking the storage frees it even if views of it are still around,
        # so a stale view fails instead of silently keeping the memory.
        buffer.untyped_storage().resize_(0)
        _account(-self.workspace_size_per_rank)

    def release(self) -> None:
        """Returns the workspace memory now; later use raises BackendError."""
        self._released = True
        self._dispatched = None
        self._free_buffer()

    def checkpoint_prepare(self) -> None:
        """FlashInfer's ``MoeAlltoAll.checkpoint_prepare``: gives the workspace
        memory back until :meth:`checkpoint_restore`; collective over the EP
        group; a repeated call does nothing.

        Raises:
            RuntimeError: a dispatch is waiting for its combine.
            BackendError: after :meth:`release`.
        """
        if self._released:
            raise BackendError("checkpoint_prepare() of a released reference all-to-all")
        if self._buffer is None:
            return
        if self._dispatched is not None:
            raise RuntimeError("Cannot unmap MNNVL handles during an active all-to-all phase")
        # Every rank stops using the workspace before any gives it back.
        dist.barrier(group=self._group)
        self._free_buffer()
        dist.barrier(group=self._group)

    def checkpoint_restore(self, comm_backend: Any) -> None:
        """FlashInfer's ``MoeAlltoAll.checkpoint_restore``: takes the workspace
        memory again (zeroed, as FlashInfer re-initializes it) and waits on
        ``comm_backend``'s barrier; a repeated call does nothing.

        Raises:
            RuntimeError: ``comm_backend``'s rank or size differs from the
                allocation's.
            BackendError: after :meth:`release`.
        """
        if self._released:
            raise BackendError("checkpoint_restore() of a released reference all-to-all")
        if self._buffer is not None:
            return
        size, rank = comm_backend.Get_size(), comm_backend.Get_rank()
        if (size, rank) != (self.ep_size, self.ep_rank):
            raise RuntimeError(
                "Cannot remap MNNVL handles because the communicator does not match the "
                f"graph-visible allocation layout: rank/size {rank}/{size} != "
                f"{self.ep_rank}/{self.ep_size}"
            )
        self._buffer = torch.zeros(self.workspace_size_per_rank, dtype=torch.uint8)
        _account(self.workspace_size_per_rank)
        comm_backend.barrier()

    # --- masks ---------------------------------------------------------

    def _checked_mask(self, active_rank_mask: int | None) -> int | None:
        return check_rank_mask(
            active_rank_mask,
            ep_size=self.ep_size,
            ep_rank=self.ep_rank,
            enable_rank_mask=self.enable_rank_mask,
        )

    # --- dispatch ------------------------------------------------------

    def _check_runtime_tokens(self, runtime_max_tokens_per_rank: int) -> None:
        if not 0 < runtime_max_tokens_per_rank <= self.max_num_tokens:
            raise RuntimeError(
                f"runtime_max_tokens_per_rank={runtime_max_tokens_per_rank} exceeds "
                f"max_num_tokens={self.max_num_tokens} (or is not positive)"
            )

    def _route(
        self, token_selected_experts: torch.Tensor, active_rank_mask: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target rank and send index per (token, k); -1 for collapsed
        duplicates and, as FlashInfer's dispatch kernel drops them, for ranks
        ``active_rank_mask`` leaves out."""
        targets = expert_owner(token_selected_experts, self.num_experts, self.ep_size)
        n, k = targets.shape
        same = targets[:, :, None] == targets[:, None, :]
        earlier = torch.ones(k, k, dtype=torch.bool).tril(diagonal=-1)
        dropped = (same & earlier).any(dim=2)
        if active_rank_mask is not None:
            member = torch.tensor(
                [(active_rank_mask >> rank) & 1 == 1 for rank in range(self.ep_size)]
            )
            dropped |= ~member[targets]
        targets = torch.where(dropped, torch.full_like(targets, -1), targets)
        send_indices = torch.full_like(targets, -1)
        flat_targets = targets.reshape(-1)
        flat_indices = send_indices.reshape(-1)
        for rank in range(self.ep_size):
            hits = flat_targets == rank
            flat_indices[hits] = torch.arange(int(hits.sum()), dtype=torch.int64)
        return targets, flat_indices.reshape(n, k)

    def _check_routing(self, tse: torch.Tensor, runtime_max_tokens_per_rank: int) -> int:
        """Checks ``token_selected_experts``; returns the local token count."""
        if tse.dtype != torch.int32 or tse.dim() != 2 or tse.size(1) != self.top_k:
            raise ValueError(
                f"token_selected_experts must be int32 [local_num_tokens, {self.top_k}], got "
                f"{tse.dtype} {list(tse.shape)}"
            )
        n = tse.size(0)
        if n > runtime_max_tokens_per_rank:
            raise ValueError(
                f"local_num_tokens={n} exceeds runtime_max_tokens_per_rank="
                f"{runtime_max_tokens_per_rank}"
            )
        if n and (int(tse.min()) < 0 or int(tse.max()) >= self.num_experts):
            raise ValueError(f"expert ids must be in [0, {self.num_experts})")
        return n

    def _payload_regions(
        self, payloads: list[torch.Tensor], n: int, runtime_max_tokens_per_rank: int
    ) -> list[int]:
        """Bytes of each payload's region, with FlashInfer's checks (shape,
        alignment, and that every region fits the workspace)."""
        if not payloads:
            raise ValueError("At least one payload is required")
        sizes: list[int] = []
        for i, payload in enumerate(payloads):
            if payload.dim() != 2 or payload.size(0) != n:
                raise ValueError(
                    f"payload {i} must be 2D with first dimension local_num_tokens={n}, got "
                    f"{list(payload.shape)}"
                )
            element = payload.element_size()
            sizes.append(self.ep_size * runtime_max_tokens_per_rank * payload.size(1) * element)
            if sum(sizes) % element:
                raise RuntimeError(
                    f"Misaligned payload buffer {i} with element size {element}. Consider "
                    "reordering payloads by largest to smallest element size"
                )
        required = self.metainfo.payload_data + sum(sizes)
        if self.workspace_size_per_rank < required:
            raise RuntimeError(
                f"workspace size per rank insufficient, need {required} bytes but has "
                f"{self.workspace_size_per_rank}"
            )
        return sizes

    def _exchange_tokens(
        self,
        tse: torch.Tensor,
        payloads: list[torch.Tensor],
        runtime_max_tokens_per_rank: int,
        active_rank_mask: int | None,
    ) -> torch.Tensor:
        """Routes every token to its target ranks and returns what this rank
        received: ``[ep_size, runtime_max_tokens_per_rank, payload bytes]``.
        Writes FlashInfer's counters and routing tables into the workspace.
        Rows and counts from ranks ``active_rank_mask`` leaves out are zero."""
        buffer, offsets = self.workspace, self.metainfo
        n = tse.size(0)
        targets, send_indices = self._route(tse, active_rank_mask)
        counts = torch.stack([(targets == r).sum() for r in range(self.ep_size)]).to(torch.int64)
        _int32_region(buffer, offsets.local_token_counter, 1).fill_(n)
        _int32_region(buffer, offsets.send_counters, self.ep_size).copy_(counts)
        _int32_region(buffer, offsets.topk_target_ranks, n * self.top_k).copy_(targets.reshape(-1))
        _int32_region(buffer, offsets.topk_send_indices, n * self.top_k).copy_(
            send_indices.reshape(-1)
        )
        # What this rank writes into each peer's payload regions, row = send index.
        token_bytes = torch.cat(
            [p.contiguous().view(torch.uint8).reshape(n, -1) for p in payloads], 1
        )
        outgoing = torch.zeros(
            self.ep_size, runtime_max_tokens_per_rank, token_bytes.size(1), dtype=torch.uint8
        )
        valid = targets >= 0
        token_of = torch.arange(n).unsqueeze(1).expand(n, self.top_k)
        outgoing[targets[valid], send_indices[valid]] = token_bytes[token_of[valid]]
        incoming = torch.empty_like(outgoing)
        received_counts = torch.empty_like(counts)
        taking_part = members(active_rank_mask, self.ep_size)
        exchange_rows(self._group, received_counts, counts, rank=self.ep_rank, members=taking_part)
        exchange_rows(self._group, incoming, outgoing, rank=self.ep_rank, members=taking_part)
        _int32_region(buffer, offsets.recv_counters, self.ep_size).copy_(received_counts)
        return incoming

    def _land(
        self,
        buffer: torch.Tensor,
        payloads: list[torch.Tensor],
        sizes: list[int],
        incoming: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Each payload's region of the workspace receives its columns of
        ``incoming``; returns the regions as ``[ep_size, tokens, *]`` views."""
        received: list[torch.Tensor] = []
        start = self.metainfo.payload_data
        column = 0
        tokens = incoming.size(1)
        for payload, size in zip(payloads, sizes, strict=True):
            per_token = size // (self.ep_size * tokens)
            region = buffer[start : start + size]
            region.view(self.ep_size, tokens, per_token).copy_(
                incoming[:, :, column : column + per_token]
            )
            received.append(region.view(payload.dtype).view(self.ep_size, tokens, -1))
            start += size
            column += per_token
        return received

    def dispatch(
        self,
        token_selected_experts: torch.Tensor,
        input_payloads: list[torch.Tensor],
        runtime_max_tokens_per_rank: int,
        invalid_token_expert_id: int | None = None,
        expert_id_payload_index: int | None = None,
        *,
        active_rank_mask: int | None = None,
    ) -> list[torch.Tensor]:
        """FlashInfer's ``MoeAlltoAll.dispatch``; collective over the EP group
        (over the members of ``active_rank_mask`` only, when given).

        Returns one ``[ep_size, runtime_max_tokens_per_rank, *]`` view of this
        rank's workspace per payload, of the payload's dtype. With
        ``invalid_token_expert_id``, the expert ids (payload
        ``expert_id_payload_index``) of every received row beyond what its
        source rank sent are set to it, as FlashInfer's sanitize kernel does
        (``moeA2ASanitizeExpertIdsKernel``); every row from a masked rank is
        such a row. ``active_rank_mask``: see
        :meth:`moe_sidecar.client.backends.base.AlltoAll.dispatch`.

        Raises:
            RuntimeError: FlashInfer's checks, among them ``workspace size per
                rank insufficient, need X bytes but has Y``.
            RankMaskError: a mask this build or this rank refuses.
            ValueError: malformed inputs (FlashInfer rejects them too).
            BackendError: after release.
        """
        buffer = self.workspace
        mask = self._checked_mask(active_rank_mask)
        if self._dispatched is not None:
            raise RuntimeError("dispatch called twice without combine")
        self._check_runtime_tokens(runtime_max_tokens_per_rank)
        n = self._check_routing(token_selected_experts, runtime_max_tokens_per_rank)
        sizes = self._payload_regions(input_payloads, n, runtime_max_tokens_per_rank)
        incoming = self._exchange_tokens(
            token_selected_experts, input_payloads, runtime_max_tokens_per_rank, mask
        )
        received = self._land(buffer, input_payloads, sizes, incoming)
        self._dispatched = _Dispatched(
            local_num_tokens=n,
            runtime_max_tokens_per_rank=runtime_max_tokens_per_rank,
            combine_payload_offset=align(self.metainfo.payload_data + sum(sizes)),
            active_rank_mask=mask,
        )
        if invalid_token_expert_id is not None:
            if expert_id_payload_index is None:
                raise ValueError(
                    "expert_id_payload_index required when invalid_token_expert_id is set"
                )
            counts = _int32_region(buffer, self.metainfo.recv_counters, self.ep_size)
            ids = received[expert_id_payload_index]
            for source in range(self.ep_size):
                ids[source, int(counts[source]) :] = invalid_token_expert_id
        return received

    # --- combine -------------------------------------------------------

    def _check_combine(
        self,
        state: _Dispatched,
        payload: torch.Tensor,
        runtime_max_tokens_per_rank: int,
        output: torch.Tensor | None,
        active_rank_mask: int | None,
    ) -> _CombineRegion:
        """FlashInfer's checks of a combine after the dispatch ``state``;
        returns where the combine payload goes and its shape.

        Raises:
            RuntimeError: the combine payload does not fit behind the dispatch
                payloads (FlashInfer's words); other FlashInfer checks.
            RankMaskError: a mask this build refuses, or not the dispatch's.
            ValueError: a malformed payload or output.
        """
        refuse_other_combine_mask(self._checked_mask(active_rank_mask), state.active_rank_mask)
        self._check_runtime_tokens(runtime_max_tokens_per_rank)
        if (
            payload.dim() != 3
            or payload.size(0) != self.ep_size
            or payload.size(1) != runtime_max_tokens_per_rank
        ):
            raise ValueError(
                "payload must be [ep_size, runtime_max_tokens_per_rank, hidden] = "
                f"[{self.ep_size}, {runtime_max_tokens_per_rank}, *], got {list(payload.shape)}"
            )
        if runtime_max_tokens_per_rank != state.runtime_max_tokens_per_rank:
            raise ValueError(
                f"runtime_max_tokens_per_rank={runtime_max_tokens_per_rank} differs from the "
                f"dispatch's {state.runtime_max_tokens_per_rank}"
            )
        payload_bytes = payload.numel() * payload.element_size()
        offset = state.combine_payload_offset
        if offset < 0 or offset + payload_bytes > self.workspace_size_per_rank:
            raise RuntimeError(
                "Check failed: (combinePayloadOffset >= 0 && combinePayloadOffset + payloadBytes "
                f"<= sizePerRank) is false ({offset} + {payload_bytes} > "
                f"{self.workspace_size_per_rank}): workspace insufficient for combine payload "
                "region"
            )
        n = state.local_num_tokens
        hidden = payload.size(2)
        if output is not None and (
            list(output.shape) != [n, hidden]
            or output.dtype != payload.dtype
            or not output.is_contiguous()
        ):
            raise ValueError(
                f"output must be a contiguous {payload.dtype} [{n}, {hidden}] tensor, got "
                f"{output.dtype} {list(output.shape)}"
            )
        return _CombineRegion(offset, payload_bytes, n, hidden)

    def _sum_over_top_k(self, buffer: torch.Tensor, gathered: torch.Tensor, n: int) -> torch.Tensor:
        """Each of the ``n`` tokens' expert outputs summed in float32 over the
        (token, k) the dispatch sent: a send index of -1 (a duplicate, or a
        masked rank) adds nothing."""
        offsets = self.metainfo
        shape = (n, self.top_k)
        targets = _int32_region(buffer, offsets.topk_target_ranks, n * self.top_k).view(shape)
        indices = _int32_region(buffer, offsets.topk_send_indices, n * self.top_k).view(shape)
        valid = indices >= 0
        token_of = torch.arange(n).unsqueeze(1).expand(shape)
        summed = torch.zeros(n, gathered.size(2), dtype=torch.float32)
        summed.index_add_(
            0,
            token_of[valid],
            gathered[targets[valid].long(), indices[valid].long()].to(torch.float32),
        )
        return summed

    def combine(
        self,
        payload: torch.Tensor,
        runtime_max_tokens_per_rank: int,
        *,
        output: torch.Tensor | None = None,
        payload_in_workspace: bool = False,
        active_rank_mask: int | None = None,
    ) -> torch.Tensor:
        """FlashInfer's ``MoeAlltoAll.combine``; collective over the EP group
        (over the members of ``active_rank_mask``, its dispatch's, when given:
        a masked rank's share of a token is left out of its sum).

        ``payload_in_workspace`` is FlashInfer's keyword (SGLang passes it):
        False, as here, means ``payload`` is the expert output itself.

        Raises:
            RuntimeError: ``... workspace insufficient for combine payload
                region`` when the combine payload does not fit behind the
                dispatch payloads, as FlashInfer raises it; other FlashInfer
                checks.
            RankMaskError: a mask this build refuses, or not the dispatch's.
            ValueError: a malformed payload or output.
            BackendError: after release.
        """
        if payload_in_workspace:
            raise ValueError(
                "payload_in_workspace=True: the reference all-to-all has no MoE output "
                "written into its workspace; pass the expert output as payload"
            )
        buffer = self.workspace
        state = self._dispatched
        if state is None:
            raise RuntimeError("combine called before successful dispatch")
        offset, payload_bytes, n, hidden = self._check_combine(
            state, payload, runtime_max_tokens_per_rank, output, active_rank_mask
        )

        # Expert outputs go back to the source rank's combine region, row
        # [expert rank, send index], as FlashInfer's combine writes them.
        region = buffer[offset : offset + payload_bytes]
        exchange_rows(
            self._group,
            region,
            payload.contiguous().view(torch.uint8).reshape(-1),
            rank=self.ep_rank,
            members=members(state.active_rank_mask, self.ep_size),
        )
        gathered = region.view(payload.dtype).view(
            self.ep_size, runtime_max_tokens_per_rank, hidden
        )
        summed = self._sum_over_top_k(buffer, gathered, n)
        self._dispatched = None
        if output is None:
            return summed.to(payload.dtype)
        output.copy_(summed)
        return output
