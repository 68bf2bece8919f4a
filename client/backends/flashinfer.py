"""FlashInfer's ``MoeAlltoAll`` (:data:`moe_sidecar.flashinfer.v0_7_2_post1.RELEASE`), built and really released.

Building: a ``Mapping`` in which the EP group is the whole tensor-parallel
world of one pipeline stage (``world_size = tp_size = moe_ep_size =
ep_size``, ``rank = ep_rank``), so ``moe_ep_size``/``moe_ep_rank`` are the
EP group's size and rank, and ``pp_rank = cp_rank = 0`` on every rank: the
``Split(pp_rank * cp_size + cp_rank, tp_rank)`` that ``MoeAlltoAll`` makes
on its communicator has a single color and keeps the EP group as it is. The
communicator (:class:`moe_sidecar.client.backends.communicator.GroupCommunicator`) runs
FlashInfer's handle exchange on the EP group's CPU group only.

Releasing: ``del moe_alltoall`` frees nothing, because the class-level
``MoeAlltoAll._WORKSPACE_CACHE`` keeps the workspace's ``MnnvlMemory``. The
release evicts the superseded entry (only if it is still the entry of that
handle's allocation) and drops every reference the instance holds
(``_WORKSPACE``, ``workspace``, ``metainfo``, ``_recv_view_cache``,
``mnnvl_mem``), so ``MnnvlMemory.__del__`` unmaps the peers' memory and
releases this rank's allocation. The manager calls it only after the barrier
that shows every rank holds the replacement.

Wrapping for vLLM 0.33 (:meth:`FlashInferBackend.communication`): FlashInfer's
own ``flashinfer.moe_ep.NVLinkOneSidedAlltoAll`` whose ``_alltoall`` is the
``MoeAlltoAll`` this backend built. ``NVLinkOneSidedAlltoAll.__init__`` always
allocates (it sizes a workspace from its params and asks
``MoeAlltoAll.get_workspace`` for it), so the object is made without running
it, with exactly the attributes ``__init__`` and ``MoEEpCommunication.__init__``
set; its methods read nothing else. Its ``destroy()`` drops the
``MoeAlltoAll``; the release below then frees the memory.

Membership masks: the object built is an instance of a subclass of
FlashInfer's class (:func:`masked_class`), constructed with
``enable_rank_mask`` when the spec asks for it, whose ``dispatch`` and
``combine`` also take the mask as an ``int`` (bit i = rank i a member): it
becomes the release's ``uint64`` words (``moe_a2a_active_rank_mask``), every
rank's when None on such a build, and a combine must take its dispatch's.
Without a mask, the calls reach FlashInfer's unchanged.

FlashInfer is imported on first use, never at import time: importing or
calling it loads its CUDA module, which CPU processes must never do.

JIT cache health: before its first build, the backend has
:func:`moe_sidecar.client.backends.jit_cache.prepare_module` log (once per process) which
FlashInfer cache the all-to-all module comes from and whether it is compiled
there, then load (or compile) the module, timed; :attr:`FlashInferBackend.module_load`
and :attr:`FlashInferBackend.first_build_seconds` say how the start went.
"""

from __future__ import annotations

import functools
import gc
import importlib
import logging
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from moe_sidecar.client.backends.base import AlltoAll, BuildSpec, CommunicationSpec
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
from moe_sidecar.flashinfer import v0_7_2_post1

__all__ = ["SUPPORTED_FLASHINFER", "FlashInferBackend", "masked_class"]

RELEASE = v0_7_2_post1.RELEASE
"""The release whose ``MoeAlltoAll`` this backend drives (the next one removed it)."""
SUPPORTED_FLASHINFER = RELEASE.name
"""Its name (flashinfer-python's version)."""

_log = logging.getLogger(__name__)

# The DLPack capsules of released workspaces (see FlashInferBackend.release).
_CAPSULES_KEPT: list[object] = []

# Instance attributes of MoeAlltoAll that reference the workspace memory.
_WORKSPACE_ATTRIBUTES = ("_WORKSPACE", "workspace", "metainfo", "_recv_view_cache", "mnnvl_mem")


class _FlashInfer:
    """The few FlashInfer names the backend uses, resolved lazily."""

    def __init__(self) -> None:
        try:
            alltoall = importlib.import_module("flashinfer.comm.trtllm_moe_alltoall")
            mnnvl = importlib.import_module("flashinfer.comm.mnnvl")
            mapping = importlib.import_module("flashinfer.comm.mapping")
        except ImportError as error:
            raise BackendError(
                "backend='flashinfer' needs flashinfer-python "
                f"{SUPPORTED_FLASHINFER} (from a moe-sidecar checkout: pip install "
                f"'.[{RELEASE.install_extra}]'); use backend='reference' on machines without GPUs"
            ) from error
        moe_alltoall = getattr(alltoall, "MoeAlltoAll", None)
        if moe_alltoall is None:
            raise BackendError(
                "this flashinfer-python has no MoeAlltoAll (removed after "
                f"{SUPPORTED_FLASHINFER}); install flashinfer-python=={SUPPORTED_FLASHINFER}"
            )
        self.MoeAlltoAll: Any = moe_alltoall
        # The release's own builder of the mask's words (absent before masks).
        self.active_rank_mask: Any = getattr(alltoall, "moe_a2a_active_rank_mask", None)
        # FlashInfer's loader of the module behind MoeAlltoAll (cached by it).
        self.get_module: Any = getattr(alltoall, "get_moe_alltoall_module", None)
        self.MnnvlConfig: Any = mnnvl.MnnvlConfig
        self.MnnvlMemory: Any = mnnvl.MnnvlMemory
        self.Mapping: Any = mapping.Mapping
        self._moe_ep: tuple[Any, Any] | None = None

    def moe_ep(self) -> tuple[Any, Any]:
        """``(flashinfer.moe_ep, QuantFormat)``, imported on first use (as vLLM
        0.33 imports them: ``from flashinfer.moe_ep import ...``, ``from
        flashinfer.fused_moe import QuantFormat``).

        Raises:
            BackendError: this FlashInfer has no ``moe_ep`` one-sided API.
        """
        if self._moe_ep is None:
            try:
                moe_ep = importlib.import_module("flashinfer.moe_ep")
                quant_format = importlib.import_module("flashinfer.fused_moe").QuantFormat
                moe_ep.NVLinkOneSidedAlltoAll  # noqa: B018 - fail here, not later
            except (ImportError, AttributeError) as error:
                raise BackendError(
                    "get_communication() needs flashinfer.moe_ep's NVLinkOneSidedAlltoAll "
                    f"(flashinfer-python {SUPPORTED_FLASHINFER}, what vLLM 0.33 pins): {error}"
                ) from error
            self._moe_ep = (moe_ep, quant_format)
        return self._moe_ep


@functools.cache
def masked_class(base: Any, build_mask: Any) -> Any:
    """FlashInfer's ``MoeAlltoAll`` (``base``) whose ``dispatch`` and ``combine``
    also take ``active_rank_mask`` as an ``int``; ``build_mask`` is the
    release's ``moe_a2a_active_rank_mask`` (None: the words are made here).
    """
    with warnings.catch_warnings():
        # FlashInfer marks MoeAlltoAll deprecated, which warns on subclassing
        # too; building one still warns as it always did.
        warnings.simplefilter("ignore", DeprecationWarning)
        return _masked_subclass(base, build_mask)


def _masked_subclass(base: Any, build_mask: Any) -> Any:
    class MoeAlltoAllWithMask(base):  # type: ignore[misc]
        """FlashInfer's class; a mask may be an ``int`` and is checked first."""

        _dispatched_mask: tuple[int | None] | None = None
        """The mask of the dispatch awaiting its combine (None: none awaits)."""

        def _kernel_mask(self, active_rank_mask: torch.Tensor | int | None) -> Any:
            return kernel_mask(
                active_rank_mask,
                ep_size=self.ep_size,
                ep_rank=self.ep_rank,
                enable_rank_mask=bool(getattr(self, "enable_rank_mask", False)),
                words=RELEASE.rank_mask_words,
                build=None
                if build_mask is None
                else functools.partial(_ranks_mask, build_mask, self.ep_size),
            )

        def dispatch(
            self, *args: Any, active_rank_mask: torch.Tensor | int | None = None, **kwargs: Any
        ) -> Any:
            """FlashInfer's ``dispatch``, the mask in the release's words.

            Raises:
                RankMaskError: a mask this build or this rank refuses; and
                    FlashInfer's own errors.
            """
            mask = self._kernel_mask(active_rank_mask)
            if mask is not None:
                kwargs["active_rank_mask"] = mask
            received = super().dispatch(*args, **kwargs)
            self._dispatched_mask = (rank_mask_from_tensor(mask),)
            return received

        def combine(
            self, *args: Any, active_rank_mask: torch.Tensor | int | None = None, **kwargs: Any
        ) -> Any:
            """FlashInfer's ``combine`` with its dispatch's mask.

            Raises:
                RankMaskError: a mask this build refuses, or not the
                    dispatch's; and FlashInfer's own errors.
            """
            mask = self._kernel_mask(active_rank_mask)
            if self._dispatched_mask is not None:  # else FlashInfer's own check speaks
                refuse_other_combine_mask(rank_mask_from_tensor(mask), self._dispatched_mask[0])
            if mask is not None:
                kwargs["active_rank_mask"] = mask
            combined = super().combine(*args, **kwargs)
            self._dispatched_mask = None
            return combined

    return MoeAlltoAllWithMask


def _ranks_mask(build_mask: Any, ep_size: int, ranks: tuple[int, ...]) -> torch.Tensor:
    mask: torch.Tensor = build_mask(list(ranks), ep_size)
    return mask


class FlashInferBackend:
    """Builds FlashInfer ``MoeAlltoAll`` objects for one EP group.

    The current CUDA device must be this rank's GPU (``torch.cuda.set_device``)
    before the first build, as for FlashInfer itself.

    Args:
        group: the EP group's CPU (gloo) process group.
    """

    name = "flashinfer"
    flashinfer_release = RELEASE

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self._fi: _FlashInfer | None = None
        self.unreleased = 0
        """Releases after which the allocation was still mapped (someone else
        kept a reference); 0 when every superseded workspace was freed."""
        self.module_load: ModuleLoad | None = None
        """How FlashInfer's all-to-all module became ready in this process
        (seconds, whether it was compiled, the cache it came from); set by the
        first build."""
        self.first_build_seconds: float | None = None
        """Wall time of this backend's first successful build: FlashInfer's
        import (when not imported yet), the module's load (or compile) and the
        first collective workspace allocation."""

    @property
    def jit_compiled(self) -> bool | None:
        """Whether this process's start compiled the all-to-all module (None: unknown yet)."""
        return self.module_load.compiled if self.module_load is not None else None

    def _flashinfer(self) -> _FlashInfer:
        if self._fi is None:
            self._fi = _FlashInfer()
        return self._fi

    def mapping_for(self, spec: BuildSpec) -> Any:
        """The FlashInfer ``Mapping`` whose MoE EP group is this EP group."""
        fi = self._flashinfer()
        return fi.Mapping(
            world_size=spec.ep_size,
            rank=spec.ep_rank,
            gpus_per_node=max(1, torch.cuda.device_count()),
            tp_size=spec.ep_size,
            moe_ep_size=spec.ep_size,
        )

    def workspace_bytes(self, capacities: Capacities, ep_size: int) -> int:
        """:attr:`flashinfer_release`'s ``moe_a2a_get_workspace_size_per_rank`` for
        ``capacities`` (see :meth:`AlltoAllBackend.workspace_bytes`)."""
        return self.flashinfer_release.workspace_bytes(capacities, ep_size)

    def build(self, spec: BuildSpec) -> AlltoAll:
        """See :meth:`AlltoAllBackend.build`; returns FlashInfer's own object.

        Raises:
            BackendError: FlashInfer is missing or lacks MoeAlltoAll.
        """
        started = time.perf_counter()
        fi = self._flashinfer()
        if self.module_load is None and fi.get_module is not None:
            self.module_load = prepare_module(fi.get_module)
        communicator = GroupCommunicator(self._group)
        if (communicator.Get_size(), communicator.Get_rank()) != (spec.ep_size, spec.ep_rank):
            raise BackendError(
                f"spec says ep_rank {spec.ep_rank} of {spec.ep_size} but the group has rank "
                f"{communicator.Get_rank()} of {communicator.Get_size()}"
            )
        if spec.enable_rank_mask and fi.active_rank_mask is None:
            raise BackendError(
                "enable_rank_mask=True: this flashinfer-python's MoeAlltoAll takes no "
                f"active-rank mask; install flashinfer-python=={SUPPORTED_FLASHINFER}"
            )
        # FlashInfer keeps the group's vote on FABRIC handles (a collective) for
        # the process; a replacement joining a new group votes afresh, so
        # every rank votes again at every build, or the survivors' next
        # collective meets the replacement's vote.
        if hasattr(fi.MnnvlMemory, "_fabric_supported"):
            fi.MnnvlMemory._fabric_supported = None
        # Passed only when asked for: the older MoeAlltoAll (vLLM 0.30's pin) has no such argument.
        mask_argument = {"enable_rank_mask": True} if spec.enable_rank_mask else {}
        handle: AlltoAll = masked_class(fi.MoeAlltoAll, fi.active_rank_mask)(
            mapping=self.mapping_for(spec),
            max_num_tokens=spec.max_num_tokens,
            top_k=spec.top_k,
            num_experts=spec.num_experts,
            workspace_size_per_rank=spec.workspace_size_per_rank,
            mnnvl_config=fi.MnnvlConfig(comm_backend=communicator),
            **mask_argument,
        )
        if self.first_build_seconds is None:
            self.first_build_seconds = time.perf_counter() - started
        return handle

    def communication(self, handle: AlltoAll, spec: CommunicationSpec) -> Any:
        """See :meth:`AlltoAllBackend.communication`: FlashInfer's own
        ``NVLinkOneSidedAlltoAll`` over ``handle``; no allocation, no collective.

        Raises:
            BackendError: ``handle`` is not a FlashInfer ``MoeAlltoAll``, this
                FlashInfer lacks ``moe_ep``, or ``num_experts`` is not a
                multiple of ``ep_size`` (FlashInfer's wrapper refuses that).
        """
        fi = self._flashinfer()
        if not isinstance(handle, fi.MoeAlltoAll):
            raise BackendError(f"the flashinfer backend cannot wrap {type(handle).__name__}")
        moe_ep, quant_format = fi.moe_ep()
        if spec.num_experts % spec.ep_size:
            raise BackendError(
                f"NVLinkOneSidedAlltoAll requires num_experts ({spec.num_experts}) divisible by "
                f"the EP size ({spec.ep_size})"
            )
        # As vLLM 0.33 describes its layer (moe_ep_objects).
        objects = moe_ep_objects(
            moe_ep,
            quant_format,
            group=self._group,
            ep_size=spec.ep_size,
            ep_rank=spec.ep_rank,
            num_experts=spec.num_experts,
            top_k=spec.top_k,
            max_tokens_per_rank=spec.max_tokens_per_rank,
            hidden_size=spec.hidden_size,
            dispatch_format_name=spec.dispatch_format_name,
            extra_payload_bytes_per_token=spec.extra_payload_bytes_per_token,
            use_low_precision_combine=spec.use_low_precision_combine,
            comm_backend=GroupCommunicator(self._group),
            enable_rank_mask=bool(getattr(handle, "enable_rank_mask", False)),
        )
        config, bootstrap, params = objects.config, objects.bootstrap, objects.params
        wrapper: Any = object.__new__(moe_ep.NVLinkOneSidedAlltoAll)
        # What NVLinkOneSidedAlltoAll.__init__ (communication.py:43-102) and
        # MoEEpCommunication.__init__ (core/comm/communication.py:169-187) set,
        # with our MoeAlltoAll in place of the one __init__ would allocate.
        wrapper.config = config
        wrapper.bootstrap = bootstrap
        wrapper.params = params
        wrapper.ep_rank = bootstrap.rank
        wrapper.ep_size = bootstrap.world_size
        wrapper.num_local_experts = params.num_experts // bootstrap.world_size
        wrapper._alltoall = handle
        wrapper._tokens_per_rank = None
        wrapper._combine_buffer = None
        return wrapper

    def release(self, handle: AlltoAll) -> None:
        """See :meth:`AlltoAllBackend.release`.

        Raises:
            BackendError: ``handle`` is not a FlashInfer ``MoeAlltoAll``.
        """
        fi = self._flashinfer()
        if not isinstance(handle, fi.MoeAlltoAll):
            raise BackendError(f"the flashinfer backend cannot release {type(handle).__name__}")
        state: dict[str, Any] = vars(handle)
        mnnvl_mem: Any = state.get("mnnvl_mem")
        if mnnvl_mem is None:
            return  # released before
        # No kernel of this rank may still touch the memory being unmapped.
        torch.cuda.synchronize()
        cache: dict[Any, dict[str, Any]] = fi.MoeAlltoAll._WORKSPACE_CACHE
        # The entry of this allocation, found by identity: its key is a 6-tuple
        # in this backend's release and a 5-tuple (no backend) in the older
        # FlashInfer vLLM 0.30 pins.
        key, entry = next(
            ((k, e) for k, e in cache.items() if e.get("mnnvl_mem") is mnnvl_mem), (None, None)
        )
        # FlashInfer wraps the workspace as a tensor through a DLPack capsule
        # whose DLManagedTensor lives in a Python object attached to that one
        # tensor. Views of it (the receive-view cache) share its storage, and
        # the storage's deleter reads that struct when the LAST of them dies,
        # which may be after the attached object is gone: releasing without
        # this crashed both ranks on 2 x H200. The struct is a few hundred
        # bytes, so keep it for the life of the process instead of waiting
        # for a full garbage collection to prove no view survives.
        _CAPSULES_KEPT.extend(
            wrapper
            for tensor in (state.get("workspace"), (entry or {}).get("workspace"))
            if (wrapper := getattr(tensor, "_capsule_wrapper", None)) is not None
        )
        if key is not None:
            del cache[key]
        ptr = int(mnnvl_mem.ptr)
        del entry, mnnvl_mem
        for attribute in _WORKSPACE_ATTRIBUTES:
            state.pop(attribute, None)
        if ptr in fi.MnnvlMemory.allocated_map:
            gc.collect()  # a reference cycle may still hold the MnnvlMemory
        if ptr in fi.MnnvlMemory.allocated_map:
            self.unreleased += 1
            _log.warning(
                "superseded FlashInfer workspace at 0x%x (%d bytes per rank) is still mapped: "
                "something outside the manager keeps its MnnvlMemory alive",
                ptr,
                state.get("workspace_size_per_rank", 0),
            )
