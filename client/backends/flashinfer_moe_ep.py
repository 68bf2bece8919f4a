"""FlashInfer's ``flashinfer.moe_ep.NVLinkOneSidedAlltoAll`` (:data:`moe_sidecar.flashinfer.v0_7_4.RELEASE`), built at the union and really released.

Its release removed ``MoeAlltoAll``: the one-sided all-to-all is the ``moe_ep``
object itself, which owns its workspace. FlashInfer shares a workspace only
between instances of identical layout (refcounted, per process), so layers
built separately get separate allocations; this backend builds ONE object
per growth, at the union of every layer's capacities, expressed in what
the release offers (:func:`moe_sidecar.flashinfer.v0_7_4.describe`): the
hidden size of the widest combine, the largest ``QuantFormat`` whose bytes
fit the widest dispatch row, and the rest as
``NVLinkOneSidedConfig.extra_payload_bytes_per_token``.

CFT counted writes and the Lamport transport are turned off
(``cft=False, lamport=False``): both change the layout (SM100 and newer),
and the pure sizing computes the fence layout, the only one on SM90. The
backend checks after every build that FlashInfer's own ``WORKSPACE_SIZE``
equals the pure size, and refuses the build otherwise.

Releasing: ``destroy()`` drops this instance's share; at refcount 0
FlashInfer pops the workspace from ``_WORKSPACES`` and drops its
``MnnvlMemory``, whose ``__del__`` unmaps the peers' memory and releases
this rank's. The release checks that the allocation left
``MnnvlMemory.allocated_map`` (:attr:`FlashInferMoeEpBackend.unreleased`
counts those that did not). The manager calls it only after the EP
barrier that shows every rank holds the replacement.

vLLM 0.33: its prepare/finalize calls ``communication.dispatch(...,
max_tokens_per_rank=...)`` (the keyword of the release vLLM pins); this release names it
``runtime_max_tokens_per_rank`` and takes no ``**kwargs``, so the plain
class raises TypeError there. The object built is an instance of a subclass
of FlashInfer's class (:func:`vllm_compatible_class`) whose ``dispatch``
takes both names; everything else is FlashInfer's. ``communication()``
returns that object itself.

Membership masks: with ``BuildSpec.enable_rank_mask`` the config says
``enable_rank_mask=True``, and the subclass's ``dispatch`` and ``combine``
also take the mask as an ``int`` (bit i = rank i a member), turned into the
release's 4 ``uint64`` words by FlashInfer's own
``NVLinkOneSidedAlltoAll.active_rank_mask`` (every rank's when None on such a
build; a combine must take its dispatch's). FlashInfer refuses a CUDA-graph
capture of such an object: the mask is fixed at capture time.

FlashInfer is imported on first use, never at import time.
"""

from __future__ import annotations

import functools
import gc
import importlib
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from moe_sidecar.client.backends.base import (
    AlltoAll,
    BuildSpec,
    CommunicationSpec,
    one_token_bound,
)
from moe_sidecar.client.backends.communicator import GroupCommunicator
from moe_sidecar.client.backends.jit_cache import ModuleLoad, prepare_module
from moe_sidecar.client.backends.moe_ep_objects import moe_ep_objects
from moe_sidecar.client.backends.rank_mask import (
    kernel_mask,
    rank_mask_from_tensor,
    refuse_other_combine_mask,
)
from moe_sidecar.client.errors import BackendError
from moe_sidecar.core.plan import Capacities
from moe_sidecar.flashinfer import LayoutError, v0_7_4

__all__ = ["SUPPORTED_FLASHINFER", "FlashInferMoeEpBackend", "vllm_compatible_class"]

RELEASE = v0_7_4.RELEASE
"""The release whose ``NVLinkOneSidedAlltoAll`` this backend drives."""
SUPPORTED_FLASHINFER = RELEASE.name
"""Its name (flashinfer-python's version)."""

_ONE_SIDED = "flashinfer.moe_ep.backends.split.comm.nvlink_one_sided"

_log = logging.getLogger(__name__)

# The DLPack capsules of released workspaces: this release still wraps
# the workspace through a capsule attached to one tensor, whose struct the
# storage's deleter reads when the last view dies (see backends/flashinfer.py).
_CAPSULES_KEPT: list[object] = []


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise BackendError(
            f"backend='flashinfer-moe-ep' needs flashinfer-python {SUPPORTED_FLASHINFER} "
            f"(from a moe-sidecar checkout: pip install '.[{RELEASE.install_extra}]'); use "
            f"backend='reference' on machines without GPUs ({error})"
        ) from error


@functools.cache
def vllm_compatible_class() -> Any:
    """This release's ``NVLinkOneSidedAlltoAll`` with a ``dispatch`` that
    also takes vLLM 0.33's ``max_tokens_per_rank=`` keyword.

    Raises:
        BackendError: FlashInfer (with ``moe_ep``) is not importable.
    """
    base: Any = _import("flashinfer.moe_ep").NVLinkOneSidedAlltoAll

    class NVLinkOneSidedAlltoAllForVllm(base):  # type: ignore[misc]
        """FlashInfer's class; ``dispatch`` takes ``max_tokens_per_rank`` too.

        vLLM 0.33's prepare/finalize passes ``max_tokens_per_rank=`` (the
        keyword of the FlashInfer release it pins); this release renamed it
        ``runtime_max_tokens_per_rank``. Both mean the same: the
        largest ``local_num_tokens`` over the ranks this step. Both
        ``dispatch`` and ``combine`` take ``active_rank_mask`` as an ``int``
        too (see the module).
        """

        _dispatched_mask: tuple[int | None] | None = None
        """The mask of the dispatch awaiting its combine (None: none awaits)."""

        def _kernel_mask(self, active_rank_mask: torch.Tensor | int | None) -> Any:
            return kernel_mask(
                active_rank_mask,
                ep_size=self.ep_size,
                ep_rank=self.ep_rank,
                enable_rank_mask=bool(self.config.enable_rank_mask),
                words=RELEASE.rank_mask_words,
                build=self.active_rank_mask,
            )

        def dispatch(
            self,
            hidden_states: torch.Tensor,
            topk_ids: torch.Tensor,
            topk_weights: torch.Tensor | None = None,
            *,
            hidden_states_scale: torch.Tensor | None = None,
            runtime_max_tokens_per_rank: int | None = None,
            max_tokens_per_rank: int | None = None,
            eplb_local_stats: torch.Tensor | None = None,
            active_rank_mask: torch.Tensor | int | None = None,
        ) -> Any:
            """FlashInfer's ``dispatch``; ``max_tokens_per_rank`` is
            ``runtime_max_tokens_per_rank`` under vLLM 0.33's name.

            Raises:
                ValueError: both names given, with different values; and
                    FlashInfer's own errors.
                RankMaskError: a mask this build or this rank refuses.
            """
            mask = self._kernel_mask(active_rank_mask)
            runtime_max_tokens_per_rank = one_token_bound(
                max_tokens_per_rank, runtime_max_tokens_per_rank
            )
            result = super().dispatch(
                hidden_states,
                topk_ids,
                topk_weights,
                hidden_states_scale=hidden_states_scale,
                runtime_max_tokens_per_rank=runtime_max_tokens_per_rank,
                eplb_local_stats=eplb_local_stats,
                active_rank_mask=mask,
            )
            self._dispatched_mask = (rank_mask_from_tensor(mask),)
            return result

        def combine(
            self,
            expert_output: torch.Tensor,
            *,
            output: torch.Tensor | None = None,
            active_rank_mask: torch.Tensor | int | None = None,
        ) -> Any:
            """FlashInfer's ``combine`` with its dispatch's mask.

            Raises:
                RankMaskError: a mask this build refuses, or not the
                    dispatch's; and FlashInfer's own errors.
            """
            mask = self._kernel_mask(active_rank_mask)
            if self._dispatched_mask is not None:  # else FlashInfer's own check speaks
                refuse_other_combine_mask(rank_mask_from_tensor(mask), self._dispatched_mask[0])
            combined = super().combine(expert_output, output=output, active_rank_mask=mask)
            self._dispatched_mask = None
            return combined

    return NVLinkOneSidedAlltoAllForVllm


class FlashInferMoeEpBackend:
    """Builds ``NVLinkOneSidedAlltoAll`` objects of :data:`RELEASE` for one EP group.

    The current CUDA device must be this rank's GPU before the first build.

    Args:
        group: the EP group's CPU (gloo) process group.
    """

    name = "flashinfer-moe-ep"
    flashinfer_release = RELEASE

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self.unreleased = 0
        """Releases after which the allocation was still mapped although no
        other instance shared it; 0 when every superseded workspace was freed."""
        self.shared_releases = 0
        """Releases of a workspace another live instance still shares (the
        same layout): FlashInfer keeps it for that one, as it must."""
        self.module_load: ModuleLoad | None = None
        """How FlashInfer's all-to-all module became ready (set by the first build)."""
        self.first_build_seconds: float | None = None

    @property
    def jit_compiled(self) -> bool | None:
        """Whether this process's start compiled the all-to-all module (None: unknown yet)."""
        return self.module_load.compiled if self.module_load is not None else None

    def workspace_bytes(self, capacities: Capacities, ep_size: int) -> int:
        """:attr:`flashinfer_release`'s ``WORKSPACE_SIZE`` for the object built for ``capacities``.

        Raises:
            BackendError: FlashInfer's layout refuses them.
        """
        try:
            return self.flashinfer_release.workspace_bytes(capacities, ep_size)
        except LayoutError as error:
            raise BackendError(
                f"FlashInfer {SUPPORTED_FLASHINFER} refuses the plan: {error}"
            ) from error

    def build(self, spec: BuildSpec) -> AlltoAll:
        """See :meth:`AlltoAllBackend.build`; returns FlashInfer's own object.

        Raises:
            BackendError: FlashInfer is missing, the object would refuse the
                plan, or FlashInfer's workspace size differs from the pure one.
        """
        started = time.perf_counter()
        cls = vllm_compatible_class()
        moe_ep = _import("flashinfer.moe_ep")
        quant_format = _import("flashinfer.fused_moe").QuantFormat
        if self.module_load is None:
            kernels = _import(f"{_ONE_SIDED}.kernels")
            self.module_load = prepare_module(kernels.get_nvlink_one_sided_alltoall_module)
        communicator = GroupCommunicator(self._group)
        if (communicator.Get_size(), communicator.Get_rank()) != (spec.ep_size, spec.ep_rank):
            raise BackendError(
                f"spec says ep_rank {spec.ep_rank} of {spec.ep_size} but the group has rank "
                f"{communicator.Get_rank()} of {communicator.Get_size()}"
            )
        c = spec.capacities
        refusals = self.flashinfer_release.object_refusals(
            spec.ep_size, c.top_k, c.num_experts, c.eplb_experts
        )
        if refusals:
            raise BackendError(f"FlashInfer {SUPPORTED_FLASHINFER}: " + "; ".join(refusals))
        d = v0_7_4.describe(c)
        objects = moe_ep_objects(
            moe_ep,
            quant_format,
            group=self._group,
            ep_size=spec.ep_size,
            ep_rank=spec.ep_rank,
            num_experts=d.num_experts,
            top_k=d.top_k,
            max_tokens_per_rank=d.max_tokens_per_rank,
            hidden_size=d.hidden_size,
            dispatch_format_name=d.dispatch_format,
            extra_payload_bytes_per_token=d.extra_payload_bytes_per_token,
            use_low_precision_combine=spec.use_low_precision_combine,
            comm_backend=communicator,
            enable_rank_mask=spec.enable_rank_mask,
            # cft and lamport change the layout the pure sizing computes (SM100+ only).
            config_fields={
                "eplb_stats_num_experts": d.eplb_stats_num_experts,
                "cft": False,
                "lamport": False,
            },
        )
        handle: Any = cls(objects.bootstrap, objects.params, objects.config)
        size = int(handle.metainfo[handle._index.WORKSPACE_SIZE_INDEX])
        if size != spec.workspace_size_per_rank:
            handle.destroy()
            raise BackendError(
                f"FlashInfer {SUPPORTED_FLASHINFER} laid out {size} bytes per rank for "
                f"{c}, the pure sizing {spec.workspace_size_per_rank}: refusing a workspace "
                "whose regions the plan does not describe"
            )
        if self.first_build_seconds is None:
            self.first_build_seconds = time.perf_counter() - started
        built: AlltoAll = handle
        return built

    def _check(self, handle: Any) -> None:
        if not isinstance(handle, vllm_compatible_class()):
            raise BackendError(
                f"the flashinfer-moe-ep backend did not build this {type(handle).__name__}"
            )

    def communication(self, handle: AlltoAll, spec: CommunicationSpec) -> Any:
        """See :meth:`AlltoAllBackend.communication`: ``handle`` itself, FlashInfer's
        ``NVLinkOneSidedAlltoAll`` (its vLLM-compatible subclass).

        Raises:
            BackendError: ``handle`` is not one this backend built.
        """
        self._check(handle)
        return handle

    def release(self, handle: AlltoAll) -> None:
        """See :meth:`AlltoAllBackend.release`: ``destroy()``, then checks the
        allocation is gone unless another live instance shares it.

        Raises:
            BackendError: ``handle`` is not one this backend built.
        """
        self._check(handle)
        obj: Any = handle
        state: dict[str, Any] | None = obj._state
        if state is None:
            return  # destroyed before (the manager's communication object is the handle)
        mnnvl = importlib.import_module("flashinfer.comm.mnnvl")
        ptr = int(state["mnnvl_mem"].ptr)
        wrapper = getattr(state.get("workspace"), "_capsule_wrapper", None)
        if wrapper is not None:
            _CAPSULES_KEPT.append(wrapper)
        torch.cuda.synchronize()
        obj.destroy()
        if state:  # refcount above 0: another instance of the same layout holds it
            self.shared_releases += 1
            return
        del state
        if ptr in mnnvl.MnnvlMemory.allocated_map:
            gc.collect()  # a reference cycle may still hold the MnnvlMemory
        if ptr in mnnvl.MnnvlMemory.allocated_map:
            self.unreleased += 1
            _log.warning(
                "superseded FlashInfer %s workspace at 0x%x is still mapped: something "
                "outside the manager keeps its MnnvlMemory alive",
                SUPPORTED_FLASHINFER,
                ptr,
            )
