"""What the manager needs from an all-to-all backend.

A backend builds an all-to-all object (FlashInfer's ``MoeAlltoAll`` or the
reference copy of its contract) at a plan's size, collectively over the EP
group, and releases a superseded one. It also wraps a built one in the
``flashinfer.moe_ep`` communication object vLLM 0.33 calls
(``NVLinkOneSidedAlltoAll``, or the reference copy of it). The manager
decides when; the backend knows how.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moe_sidecar.core.plan import Capacities
from moe_sidecar.flashinfer import Release

__all__ = ["AlltoAll", "AlltoAllBackend", "BuildSpec", "CommunicationSpec", "one_token_bound"]


@dataclass(frozen=True)
class BuildSpec:
    """Everything a backend needs to build one all-to-all for one EP rank."""

    ep_size: int
    ep_rank: int
    capacities: Capacities
    workspace_size_per_rank: int
    """Derived from ``capacities`` by the backend's :meth:`AlltoAllBackend.workspace_bytes`."""
    use_low_precision_combine: bool = False
    """Whether the engine combines in FP8 (the engine room's rule): for a
    backend whose built object is the ``moe_ep`` one."""
    enable_rank_mask: bool = False
    """Build kernels that take an active-rank mask on every dispatch and
    combine (FlashInfer's ``enable_rank_mask``): only such a build can serve
    a membership view without some of its ranks."""

    @property
    def max_num_tokens(self) -> int:
        return self.capacities.max_tokens

    @property
    def top_k(self) -> int:
        return self.capacities.top_k

    @property
    def num_experts(self) -> int:
        return self.capacities.num_experts


@dataclass(frozen=True)
class CommunicationSpec:
    """How to describe a built all-to-all as FlashInfer's ``moe_ep`` object.

    The fields are those of FlashInfer's ``MoEEpCommParams`` and
    ``NVLinkOneSidedConfig`` that vLLM 0.33 sets (``dtype`` is always bf16).
    They describe; the workspace itself was sized by the plan's capacities,
    so ``FlashInfer's dispatch bytes of (dispatch_format, hidden_size) +
    extra_payload_bytes_per_token + 8 * top_k`` equals the plan's dispatch
    bytes per token whenever some format fits under them.
    """

    ep_size: int
    ep_rank: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    hidden_size: int
    """The largest hidden size of the plan (its combine rows are bf16)."""
    dispatch_format: object
    """A ``QuantFormat`` (or its name), or None for bf16 rows."""
    dispatch_format_name: str | None
    extra_payload_bytes_per_token: int
    use_low_precision_combine: bool


class AlltoAll(Protocol):
    """The part of FlashInfer's ``MoeAlltoAll`` contract the client relies on."""

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
        """Sends each token's payloads to the ranks owning its top-k experts.

        Returns one ``[ep_size, runtime_max_tokens_per_rank, *]`` tensor per
        payload: row ``[src, i]`` is the i-th token rank ``src`` sent here.
        With ``invalid_token_expert_id``, the expert ids (payload
        ``expert_id_payload_index``) of rows that carry no token are set to it.
        With ``active_rank_mask`` (bit i set = rank i is a member; None: every
        rank; only on a build with ``enable_rank_mask``), a token's copy for a
        masked rank is dropped, not re-routed, as FlashInfer's kernels do, and
        no masked rank takes part.

        Raises:
            RankMaskError: a mask on a build without ``enable_rank_mask``, one
                without this rank's bit, or with bits beyond ``ep_size``
                (:mod:`moe_sidecar.client.backends.rank_mask`).
        """
        ...

    def combine(
        self,
        payload: torch.Tensor,
        runtime_max_tokens_per_rank: int,
        *,
        output: torch.Tensor | None = None,
        active_rank_mask: int | None = None,
    ) -> torch.Tensor:
        """Sends expert outputs back and sums them per token over its top-k.

        Returns ``[local_num_tokens, hidden]`` (``output`` when given).
        ``active_rank_mask`` must be the one its dispatch was given: a masked
        rank's share of a token is left out of the sum.

        Raises:
            RankMaskError: as :meth:`dispatch`.
        """
        ...

    def checkpoint_prepare(self) -> None:
        """Releases the workspace's backing for a checkpoint; collective."""
        ...

    def checkpoint_restore(self, comm_backend: Any) -> None:
        """Maps the workspace again after :meth:`checkpoint_prepare`; collective."""
        ...


class AlltoAllBackend(Protocol):
    """Builds and releases all-to-all objects for one EP group."""

    @property
    def name(self) -> str:
        """``"flashinfer"`` (``MoeAlltoAll``), ``"flashinfer-moe-ep"``
        (``flashinfer.moe_ep``) or ``"reference"``."""
        ...

    @property
    def flashinfer_release(self) -> Release:
        """The FlashInfer release whose workspace this backend builds (or, for
        the reference backend, lays out): what the rank's proposals state."""
        ...

    def workspace_bytes(self, capacities: Capacities, ep_size: int) -> int:
        """Per-rank workspace bytes this backend builds for ``capacities``: the
        backend's size function (plans hold capacities, never bytes)."""
        ...

    def build(self, spec: BuildSpec) -> AlltoAll:
        """Builds an all-to-all at ``spec``'s size.

        Collective over the EP group: every rank calls it with the same sizes.

        Raises:
            BackendError: the backend cannot build here (e.g. FlashInfer missing).
        """
        ...

    def communication(self, handle: AlltoAll, spec: CommunicationSpec) -> Any:
        """``handle`` as the ``flashinfer.moe_ep`` communication object vLLM 0.33
        uses (``dispatch(x, topk_ids, topk_weights, hidden_states_scale=,
        max_tokens_per_rank=)``, ``combine(expert_output, output=)``,
        ``params``, ``config``, ``alltoall``, ``destroy()``), over the same
        workspace: nothing is allocated, nothing collective runs.

        Raises:
            BackendError: the backend cannot describe ``handle`` so.
        """
        ...

    def release(self, handle: AlltoAll) -> None:
        """Frees ``handle``'s workspace now; ``handle`` is unusable afterwards.

        Local to this rank. Call it only once every rank of the EP group holds
        the replacement (after the barrier): peers may still read this
        rank's workspace until then.
        """
        ...


def one_token_bound(
    max_tokens_per_rank: int | None, runtime_max_tokens_per_rank: int | None
) -> int | None:
    """A dispatch's token bound from either of its names: ``max_tokens_per_rank``
    (the keyword of the FlashInfer release vLLM 0.33 pins, which vLLM 0.33
    passes) or ``runtime_max_tokens_per_rank`` (the ``moe_ep`` release's,
    which vLLM 0.34 passes); None when neither is given.

    Raises:
        ValueError: both given, with different values.
    """
    if max_tokens_per_rank is None:
        return runtime_max_tokens_per_rank
    if runtime_max_tokens_per_rank not in (None, max_tokens_per_rank):
        raise ValueError(
            f"max_tokens_per_rank={max_tokens_per_rank} and "
            f"runtime_max_tokens_per_rank={runtime_max_tokens_per_rank} differ; "
            "they name the same value"
        )
    return max_tokens_per_rank
