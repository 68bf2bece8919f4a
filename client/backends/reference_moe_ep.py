"""FlashInfer's moe_ep communication object, over the reference all-to-all.

:class:`ReferenceCommunication` is a copy of FlashInfer's
``flashinfer.moe_ep.NVLinkOneSidedAlltoAll`` (the object vLLM 0.33 dispatches
and combines through), over a
:class:`~moe_sidecar.client.backends.reference_alltoall.ReferenceAlltoAll`, with
``params`` and ``config`` holding the fields of FlashInfer's
``MoEEpCommParams`` and ``NVLinkOneSidedConfig``.
:mod:`moe_sidecar.client.backends.reference` re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_sidecar.client.backends.base import one_token_bound
from moe_sidecar.client.backends.rank_mask import rank_mask_from_tensor
from moe_sidecar.client.backends.reference_alltoall import ReferenceAlltoAll
from moe_sidecar.client.engines.vllm.sizing import dispatch_format_name
from moe_sidecar.client.errors import BackendError
from moe_sidecar.flashinfer import v0_7_2_post1

__all__ = [
    "ReferenceCommParams",
    "ReferenceCommunication",
    "ReferenceDispatchResult",
    "ReferenceOneSidedConfig",
]


@dataclass(frozen=True)
class ReferenceCommParams:
    """The fields of FlashInfer's ``MoEEpCommParams``
    (``flashinfer/moe_ep/core/comm/communication.py:71``)."""

    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    hidden_size: int
    dtype: torch.dtype | None = None
    dispatch_format: object = None
    invalid_expert_id: int = -1

    @property
    def token_dtype(self) -> torch.dtype:
        """``dtype``, defaulting to bf16."""
        return torch.bfloat16 if self.dtype is None else self.dtype

    @property
    def dispatch_bytes_per_token(self) -> int:
        """Bytes of one token's dispatched activations, scale factors included."""
        name = dispatch_format_name(self.dispatch_format)
        if name is None:
            return self.hidden_size * self.token_dtype.itemsize
        return v0_7_2_post1.DISPATCH_FORMAT_BYTES[name](self.hidden_size)


@dataclass
class ReferenceOneSidedConfig:
    """The fields of FlashInfer's ``NVLinkOneSidedConfig``
    (``flashinfer/moe_ep/backends/split/comm/nvlink_one_sided/config.py:12``)."""

    backend_name: str = "nvlink_one_sided"
    extra_payload_bytes_per_token: int = 0
    eplb_stats_num_experts: int = 0
    enable_rank_mask: bool = False
    use_low_precision_combine: bool = False
    comm_backend: Any = None


@dataclass(frozen=True)
class ReferenceDispatchResult:
    """The fields of FlashInfer's ``MoEEpDispatchResult``: rank-major receive
    rows, ``[ep_size * tokens_per_rank, *]`` each."""

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor | None
    tokens_per_rank: int
    hidden_states_scale: torch.Tensor | None = None
    eplb_gathered_stats: torch.Tensor | None = None


class ReferenceCommunication:
    """The ``NVLinkOneSidedAlltoAll`` of the reference backend's release
    (:data:`moe_sidecar.flashinfer.v0_7_2_post1.RELEASE`) over a
    :class:`ReferenceAlltoAll`: the same ``dispatch``/``combine`` (the method
    bodies follow ``moe_ep/backends/split/comm/nvlink_one_sided/communication.py``
    line by line), ``params``, ``config``, ``alltoall`` and ``destroy()``.
    """

    backend_name = "nvlink_one_sided"

    def __init__(
        self,
        alltoall: ReferenceAlltoAll,
        params: ReferenceCommParams,
        config: ReferenceOneSidedConfig,
    ) -> None:
        self.params = params
        self.config = config
        self.ep_rank = alltoall.ep_rank
        self.ep_size = alltoall.ep_size
        self.num_local_experts = params.num_experts // self.ep_size
        self._alltoall: ReferenceAlltoAll | None = alltoall
        self._tokens_per_rank: int | None = None
        self._combine_input: torch.Tensor | None = None

    @property
    def alltoall(self) -> ReferenceAlltoAll:
        """The underlying all-to-all.

        Raises:
            RuntimeError: after :meth:`destroy` (FlashInfer's words).
        """
        if self._alltoall is None:
            raise RuntimeError("NVLinkOneSidedAlltoAll has been destroyed")
        return self._alltoall

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor | None = None,
        *,
        hidden_states_scale: torch.Tensor | None = None,
        max_tokens_per_rank: int | None = None,
        runtime_max_tokens_per_rank: int | None = None,
        eplb_local_stats: torch.Tensor | None = None,
        active_rank_mask: torch.Tensor | int | None = None,
    ) -> ReferenceDispatchResult:
        """Sends each token to the ranks owning its experts; collective.

        ``hidden_states`` ``[local_T, *]``, ``topk_ids`` ``[local_T, top_k]``
        (global expert ids, cast to int32), ``topk_weights`` ``[local_T,
        top_k]`` float32, ``hidden_states_scale`` ``[local_T, *]``. Every
        received tensor is ``[ep_size * tokens_per_rank, *]``. ``active_rank_mask``
        (FlashInfer's CPU ``uint64`` words, or an ``int``; only with
        ``config.enable_rank_mask``): tokens routed to a masked rank are dropped.
        The step's token bound comes as ``runtime_max_tokens_per_rank`` (the
        keyword of FlashInfer's newer release, which vLLM 0.34 passes) or
        ``max_tokens_per_rank`` (vLLM 0.33's); both given, they must agree.

        Raises:
            RuntimeError: a dispatch without its combine, or after destroy.
            RankMaskError: a mask the all-to-all refuses.
            ValueError: the token bound outside ``(0, params.max_tokens_per_rank]``,
                or both names given with different values.
            BackendError: EPLB statistics (not in the reference).
        """
        if eplb_local_stats is not None:
            raise BackendError("the reference backend does not gather EPLB stats")
        mask = rank_mask_from_tensor(active_rank_mask)
        alltoall = self.alltoall
        if self._tokens_per_rank is not None:
            raise RuntimeError("dispatch called twice without an intervening combine")
        asked = one_token_bound(max_tokens_per_rank, runtime_max_tokens_per_rank)
        tokens_per_rank = self.params.max_tokens_per_rank if asked is None else asked
        if not 0 < tokens_per_rank <= self.params.max_tokens_per_rank:
            name = (
                "max_tokens_per_rank"
                if runtime_max_tokens_per_rank is None
                else "runtime_max_tokens_per_rank"
            )
            raise ValueError(
                f"{name}={tokens_per_rank} must be in (0, {self.params.max_tokens_per_rank}]"
            )
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        payloads = [hidden_states]
        if hidden_states_scale is not None:
            payloads.append(hidden_states_scale)
        expert_id_index = len(payloads)
        payloads.append(topk_ids)
        if topk_weights is not None:
            payloads.append(topk_weights)
        recv = alltoall.dispatch(
            topk_ids,
            payloads,
            tokens_per_rank,
            invalid_token_expert_id=self.params.invalid_expert_id,
            expert_id_payload_index=expert_id_index,
            active_rank_mask=mask,
        )
        self._tokens_per_rank = tokens_per_rank
        recv = [t.flatten(0, 1) for t in recv]
        return ReferenceDispatchResult(
            hidden_states=recv[0],
            hidden_states_scale=recv[1] if hidden_states_scale is not None else None,
            topk_ids=recv[expert_id_index],
            topk_weights=recv[expert_id_index + 1] if topk_weights is not None else None,
            tokens_per_rank=tokens_per_rank,
            eplb_gathered_stats=None,
        )

    def get_combine_input_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer the expert computation may write its output into, as
        FlashInfer's newer release hands out a view of its workspace's combine
        input region: ``[ep_size * tokens_per_rank, hidden_size]`` of
        ``dtype`` for the dispatch awaiting its combine (vLLM 0.34's
        ``allocate_fused_expert_output`` reads its shape with no None check).
        Passing it to :meth:`combine` is what vLLM does with it. One buffer
        per object, sized for 16-bit rows at ``params.max_tokens_per_rank``
        (FlashInfer's region's capacity), made on first use and dropped by
        :meth:`destroy`.

        Raises:
            RuntimeError: before a dispatch, or after destroy (FlashInfer's words).
            ValueError: a ``dtype`` wider than 16 bits, which the region cannot hold.
        """
        self.alltoall  # noqa: B018 - raises after destroy, as FlashInfer's object does
        tokens_per_rank = self._tokens_per_rank
        if tokens_per_rank is None:
            raise RuntimeError("get_combine_input_buffer called before dispatch")
        rows = self.ep_size * tokens_per_rank
        capacity = self.ep_size * self.params.max_tokens_per_rank * self.params.hidden_size * 2
        nbytes = rows * self.params.hidden_size * dtype.itemsize
        if nbytes > capacity:
            raise ValueError(
                f"a {dtype} combine input needs {nbytes} bytes, more than the "
                f"{capacity}-byte combine region"
            )
        if self._combine_input is None:
            self._combine_input = torch.empty(capacity, dtype=torch.uint8)
        return self._combine_input[:nbytes].view(dtype).view(rows, self.params.hidden_size)

    def combine(
        self,
        expert_output: torch.Tensor,
        *,
        output: torch.Tensor | None = None,
        active_rank_mask: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Sums each token's expert outputs back on its source rank; collective.

        ``expert_output`` ``[ep_size * tokens_per_rank, hidden]`` (or 3-D);
        returns ``[local_T, hidden]`` (``output`` when given). ``active_rank_mask``
        must be the dispatch's.

        Raises:
            RuntimeError: before dispatch, or after destroy.
            RankMaskError: a mask the all-to-all refuses, or not the dispatch's.
            ValueError: ``expert_output`` neither 2-D nor 3-D.
            BackendError: low-precision combine (not in the reference).
        """
        if self.config.use_low_precision_combine:
            raise BackendError("the reference backend has no low-precision combine")
        mask = rank_mask_from_tensor(active_rank_mask)
        alltoall = self.alltoall
        tokens_per_rank = self._tokens_per_rank
        if tokens_per_rank is None:
            raise RuntimeError("combine called before dispatch")
        if expert_output.dim() == 2:
            payload = expert_output.view(self.ep_size, tokens_per_rank, -1)
        elif expert_output.dim() == 3:
            payload = expert_output
        else:
            raise ValueError(
                f"expert_output must be 2D or 3D, got shape {tuple(expert_output.shape)}"
            )
        combined = alltoall.combine(payload, tokens_per_rank, output=output, active_rank_mask=mask)
        self._tokens_per_rank = None
        return combined

    def destroy(self) -> None:
        """Drops the all-to-all (FlashInfer's ``destroy()``: frees nothing itself)."""
        self._alltoall = None
        self._tokens_per_rank = None
        self._combine_input = None
