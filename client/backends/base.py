"""What the manager needs from an all-to-all backend.

A backend builds an all-to-all object (FlashInfer's ``MoeAlltoAll`` or the
reference copy of its contract) at a plan's size, collectively over the EP
group, and releases a superseded one. The manager decides when; the backend
knows how.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moe_sidecar.plan import Capacities

__all__ = ["AlltoAll", "AlltoAllBackend", "BuildSpec"]


@dataclass(frozen=True)
class BuildSpec:
    """Everything a backend needs to build one all-to-all for one EP rank."""

    ep_size: int
    ep_rank: int
    capacities: Capacities
    workspace_size_per_rank: int
    """Derived from ``capacities`` by the backend's :meth:`AlltoAllBackend.workspace_bytes`."""

    @property
    def max_num_tokens(self) -> int:
        return self.capacities.max_tokens

    @property
    def top_k(self) -> int:
        return self.capacities.top_k

    @property
    def num_experts(self) -> int:
        return self.capacities.num_experts


class AlltoAll(Protocol):
    """The part of FlashInfer's ``MoeAlltoAll`` contract the client relies on."""

    def dispatch(
        self,
        token_selected_experts: torch.Tensor,
        input_payloads: list[torch.Tensor],
        runtime_max_tokens_per_rank: int,
    ) -> list[torch.Tensor]:
        """Sends each token's payloads to the ranks owning its top-k experts.

        Returns one ``[ep_size, runtime_max_tokens_per_rank, *]`` tensor per
        payload: row ``[src, i]`` is the i-th token rank ``src`` sent here.
        """
        ...

    def combine(
        self,
        payload: torch.Tensor,
        runtime_max_tokens_per_rank: int,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sends expert outputs back and sums them per token over its top-k.

        Returns ``[local_num_tokens, hidden]`` (``output`` when given).
        """
        ...


class AlltoAllBackend(Protocol):
    """Builds and releases all-to-all objects for one EP group."""

    @property
    def name(self) -> str:
        """``"flashinfer"`` or ``"reference"``."""
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

    def release(self, handle: AlltoAll) -> None:
        """Frees ``handle``'s workspace now; ``handle`` is unusable afterwards.

        Local to this rank. Call it only once every rank of the EP group holds
        the replacement (after the barrier): peers may still read this
        rank's workspace until then.
        """
        ...
