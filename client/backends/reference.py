"""The reference backend: a CPU all-to-all with FlashInfer ``MoeAlltoAll``'s
contract, over gloo, and FlashInfer's moe_ep communication object over it.

:class:`ReferenceBackend` builds
:class:`~moe_sidecar.client.backends.reference_alltoall.ReferenceAlltoAll`
objects (see that module for what the copy is faithful to) and wraps them in
:class:`~moe_sidecar.client.backends.reference_moe_ep.ReferenceCommunication`;
this module re-exports both modules' public names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_sidecar.client.backends.base import AlltoAll, BuildSpec, CommunicationSpec
from moe_sidecar.client.backends.reference_alltoall import (
    ReferenceAlltoAll,
    expert_owner,
    live_workspace_bytes,
)
from moe_sidecar.client.backends.reference_moe_ep import (
    ReferenceCommParams,
    ReferenceCommunication,
    ReferenceDispatchResult,
    ReferenceOneSidedConfig,
)
from moe_sidecar.client.errors import BackendError
from moe_sidecar.core.plan import Capacities
from moe_sidecar.flashinfer import v0_7_2_post1

__all__ = [
    "ReferenceAlltoAll",
    "ReferenceBackend",
    "ReferenceCommParams",
    "ReferenceCommunication",
    "ReferenceDispatchResult",
    "ReferenceOneSidedConfig",
    "expert_owner",
    "live_workspace_bytes",
]


class ReferenceBackend:
    """Builds :class:`ReferenceAlltoAll` objects on one EP group's gloo group."""

    name = "reference"
    flashinfer_release = v0_7_2_post1.RELEASE
    """The release whose ``MoeAlltoAll`` layout the reference copy follows."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def workspace_bytes(self, capacities: Capacities, ep_size: int) -> int:
        """:attr:`flashinfer_release`'s ``moe_a2a_get_workspace_size_per_rank`` for
        ``capacities`` (see :meth:`AlltoAllBackend.workspace_bytes`)."""
        return self.flashinfer_release.workspace_bytes(capacities, ep_size)

    def build(self, spec: BuildSpec) -> ReferenceAlltoAll:
        """See :meth:`AlltoAllBackend.build`.

        Raises:
            ValueError: sizes FlashInfer would refuse.
            RuntimeError: ranks asked for different sizes.
        """
        return ReferenceAlltoAll(self._group, spec)

    def communication(self, handle: AlltoAll, spec: CommunicationSpec) -> ReferenceCommunication:
        """See :meth:`AlltoAllBackend.communication`.

        Raises:
            BackendError: ``handle`` is not a reference all-to-all.
        """
        if not isinstance(handle, ReferenceAlltoAll):
            raise BackendError(f"the reference backend cannot wrap {type(handle).__name__}")
        params = ReferenceCommParams(
            num_experts=spec.num_experts,
            top_k=spec.top_k,
            max_tokens_per_rank=spec.max_tokens_per_rank,
            hidden_size=spec.hidden_size,
            dtype=torch.bfloat16,
            dispatch_format=spec.dispatch_format,
        )
        config = ReferenceOneSidedConfig(
            extra_payload_bytes_per_token=spec.extra_payload_bytes_per_token,
            use_low_precision_combine=spec.use_low_precision_combine,
            enable_rank_mask=handle.enable_rank_mask,
        )
        return ReferenceCommunication(handle, params, config)

    def release(self, handle: AlltoAll) -> None:
        """See :meth:`AlltoAllBackend.release`.

        Raises:
            BackendError: ``handle`` is not a reference all-to-all.
        """
        if not isinstance(handle, ReferenceAlltoAll):
            raise BackendError(f"the reference backend cannot release {type(handle).__name__}")
        handle.release()
