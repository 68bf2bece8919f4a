"""vLLM 0.33's fault tolerance (``--enable-fault-tolerance``) served by moe-sidecar's manager.

What vLLM 0.33 asks of the all-to-all manager ``get_ep_all2all_manager()``
returns (with ``--all2all-backend flashinfer_nvlink_one_sided`` that is
vLLM's ``CudaCommunicator.all2all_manager``, the plugin's subclass of
:class:`~moe_sidecar.client.engines.vllm.manager.WorkspaceManager`):

* ``WorkerSentinel.__init__`` (``vllm/v1/worker/sentinel/gpu_worker_sentinel.py``)
  refuses a ``parallel_config.all2all_backend`` outside the module's
  ``FT_BACKEND_SET`` (``deepep_low_latency``, ``nixl_ep``): the plugin adds
  :data:`FT_BACKEND` (:func:`extend_ft_backends`), only in sidecar mode
  under ``MOE_SIDECAR_ON_PEER_LOSS=mask``, where the manager can serve it;
* the model runner reads ``support_fault_tolerance`` once (``data_parallel_size
  > 1`` and a MoE model), and when it is true calls ``query_fault()`` after
  every step (a 0-dim bool tensor it copies to the CPU) and, on True,
  ``query_active_mask()`` (int32 per EP rank, 0 live, 1 masked) for the
  error it raises; the engine aborts its requests;
* on the orchestrator's retry, ``WorkerSentinel.retry`` synchronizes, clears
  the model runner's requests and (``data_parallel_size > 1``) calls
  ``clean_buffers()`` before it re-forms the DP group;
* vLLM 0.34's retry (and its ``scale_down``, which runs it) then replays
  ``update_mask(ep_rank, masked=True)`` for every EP rank of the
  cumulative dead set it was given (``compute_dead_ep_ranks``): how vLLM
  tells the manager its dead set. :func:`check_update_mask` meets it with
  the committed view ``clean_buffers()`` adopted: accepted when the view
  already excludes the rank, refused by name when the view still counts it
  a member (the sidecar masks a rank only once it saw it leave: a
  suspicion never evicts a live rank, and only an operator's
  ``ExcludeRanks`` drains one), and ``masked=False`` refused (a rank comes
  back only through the manager's ``rejoin()``).

The decisions here are pure (:func:`supports_fault_tolerance`,
:func:`masked_flags`); :func:`extend_ft_backends` is the one change to
vLLM's module. vLLM is imported only by :func:`extend_ft_backends` and
:meth:`VllmFaultTolerance.current` (when vLLM is already loaded).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from moe_sidecar.core.defaults import ENV_ON_PEER_LOSS, ENV_TARGET
from moe_sidecar.core.errors import InvalidArgument, PreconditionFailed, quote_name

__all__ = [
    "FT_BACKEND",
    "FT_BACKEND_SET_NAME",
    "GRAPHLESS_MASK_BACKENDS",
    "SENTINEL_MODULE",
    "FaultToleranceUnsupported",
    "VllmFaultTolerance",
    "check_update_mask",
    "extend_ft_backends",
    "masked_flags",
    "supports_fault_tolerance",
]

FT_BACKEND: Final = "flashinfer_nvlink_one_sided"
"""vLLM's ``--all2all-backend`` whose manager (``FlashInferNVLinkOneSidedManager``)
the plugin replaces: the one name fault tolerance must accept for it."""
SENTINEL_MODULE: Final = "vllm.v1.worker.sentinel.gpu_worker_sentinel"
FT_BACKEND_SET_NAME: Final = "FT_BACKEND_SET"
GRAPHLESS_MASK_BACKENDS: Final = frozenset({"flashinfer-moe-ep"})
"""Backends whose all-to-all built with ``enable_rank_mask`` refuses a CUDA-graph
capture (FlashInfer's ``moe_ep``: the mask is fixed at capture time)."""

_log = logging.getLogger("vllm.plugins.moe_sidecar")


class FaultToleranceUnsupported(InvalidArgument):
    """vLLM's fault tolerance is on but the manager cannot serve it as configured
    (the message names the setting and what to change)."""


@dataclass(frozen=True)
class VllmFaultTolerance:
    """What vLLM's config says of fault tolerance, as the manager needs it."""

    enabled: bool
    """``parallel_config.enable_fault_tolerance``."""
    cudagraph_mode: str
    """``compilation_config.cudagraph_mode``'s name (``"NONE"``: no CUDA graphs)."""

    @classmethod
    def of(cls, config: Any) -> VllmFaultTolerance:
        """From a ``VllmConfig`` (None: outside vLLM, fault tolerance off).

        An unresolved ``cudagraph_mode`` (None) counts as graphs on unless
        ``model_config.enforce_eager``: vLLM resolves it to a capturing mode.
        """
        if config is None:
            return cls(enabled=False, cudagraph_mode="NONE")
        parallel = getattr(config, "parallel_config", None)
        enabled = bool(getattr(parallel, "enable_fault_tolerance", False))
        mode = getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None)
        if mode is None:
            eager = bool(getattr(getattr(config, "model_config", None), "enforce_eager", False))
            name = "NONE" if eager else "UNRESOLVED"
        else:
            name = str(getattr(mode, "name", mode))
        return cls(enabled=enabled, cudagraph_mode=name)

    @classmethod
    def current(cls) -> VllmFaultTolerance:
        """From vLLM's current config, when vLLM is loaded and one is set
        (as while vLLM's ``CudaCommunicator`` constructs the manager)."""
        config_module = sys.modules.get("vllm.config")
        current = getattr(config_module, "get_current_vllm_config_or_none", None)
        return cls.of(current() if callable(current) else None)

    @property
    def cuda_graphs(self) -> bool:
        """Whether vLLM captures CUDA graphs."""
        return self.cudagraph_mode != "NONE"


def supports_fault_tolerance(
    vllm: VllmFaultTolerance, *, masking: bool, sidecar: bool, backend: str
) -> bool:
    """The manager's ``support_fault_tolerance``: vLLM's fault tolerance on,
    ``MOE_SIDECAR_ON_PEER_LOSS=mask`` (``masking``) in sidecar mode, and no
    CUDA graphs where the backend's masked all-to-all refuses their capture.

    Raises:
        FaultToleranceUnsupported: vLLM's fault tolerance on, masking, but
            CUDA graphs with a backend of :data:`GRAPHLESS_MASK_BACKENDS`
            (the capture would fail later, in FlashInfer).
    """
    if not (vllm.enabled and masking and sidecar):
        return False
    if vllm.cuda_graphs and backend in GRAPHLESS_MASK_BACKENDS:
        raise FaultToleranceUnsupported.of(
            "compilation_config.cudagraph_mode",
            vllm.cudagraph_mode,
            f"vLLM's fault tolerance with {ENV_ON_PEER_LOSS}=mask on the {backend} backend "
            "needs no CUDA graphs (its masked all-to-all refuses a capture); run vLLM with "
            "--enforce-eager or -cc.cudagraph_mode=none",
        )
    return True


def masked_flags(active_mask: int, ep_size: int, lost: Iterable[int] = ()) -> list[int]:
    """vLLM's mask of ``ep_size`` EP ranks (0 live, 1 masked) from FlashInfer's
    ``active_mask`` (bit i set = rank i a member) and the ranks known ``lost``
    that no adopted view has masked yet.

    Raises:
        ValueError: ``ep_size`` below 1, ``active_mask`` negative or with bits
            at or beyond ``ep_size``, or a lost rank outside ``[0, ep_size)``.
    """
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size}: must be at least 1")
    if active_mask < 0 or active_mask >> ep_size:
        raise ValueError(f"active_mask={active_mask:#x}: sets bits beyond ep_size={ep_size}")
    gone = set(lost)
    outside = sorted(r for r in gone if not 0 <= r < ep_size)
    if outside:
        raise ValueError(f"lost={outside}: ranks outside [0, {ep_size})")
    return [0 if (active_mask >> r) & 1 and r not in gone else 1 for r in range(ep_size)]


def extend_ft_backends(mode: str | None, masking: bool) -> bool:
    """Adds :data:`FT_BACKEND` to vLLM's ``FT_BACKEND_SET`` when the manager can
    serve fault tolerance (``mode == "sidecar"`` and ``masking``); returns
    whether it changed the set. Idempotent. ``WorkerSentinel`` reads the
    module's name at construction, so a new frozenset in its place is seen.

    A vLLM without the sentinel module (before 0.33) has no fault tolerance:
    nothing to extend.
    """
    if mode != "sidecar" or not masking:
        return False
    try:
        module = importlib.import_module(SENTINEL_MODULE)
    except ModuleNotFoundError:
        return False
    current = frozenset(getattr(module, FT_BACKEND_SET_NAME))
    if FT_BACKEND in current:
        return False
    setattr(module, FT_BACKEND_SET_NAME, current | {FT_BACKEND})
    _log.info(
        "moe-sidecar: vLLM fault tolerance accepts --all2all-backend %s (%s=mask, %s set): "
        "the manager answers query_fault(), query_active_mask() and clean_buffers()",
        FT_BACKEND,
        ENV_ON_PEER_LOSS,
        ENV_TARGET,
    )
    return True


def check_update_mask(
    group: str, rank: int, masked: object, ep_size: int, view: tuple[int, tuple[int, ...]] | None
) -> None:
    """vLLM 0.34's ``update_mask(rank, masked)`` against the adopted ``view``
    (its number and members; None: none adopted): returns when the view
    already masks ``rank``.

    Raises:
        InvalidArgument: ``rank`` outside ``[0, ep_size)``, or ``masked`` not a bool.
        PreconditionFailed: ``masked=False`` (a rank comes back through
            ``rejoin()``, which rebuilds every member with it), no view adopted
            (no death was followed: ``clean_buffers()`` adopts one), or the
            view still counts ``rank`` a member; each names the rank and the view.
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < ep_size:
        raise InvalidArgument.of("rank", rank, f"must be an EP rank in [0, {ep_size})")
    if not isinstance(masked, bool):
        raise InvalidArgument.of("masked", masked, "must be True or False")
    name = quote_name(group)
    if not masked:
        raise PreconditionFailed(
            f"update_mask(rank={rank}, masked=False) in EP group {name}: a masked rank comes "
            "back only through a new view with a replacement in it, where every member "
            "rebuilds (the manager's rejoin() over the re-formed CPU group); the mask is the "
            "committed view's, not set per rank"
        )
    if view is None:
        raise PreconditionFailed(
            f"update_mask(rank={rank}) in EP group {name}: no membership view is adopted "
            "(clean_buffers() adopts the one the sidecar proposes after a death; nothing "
            "built, or not under MOE_SIDECAR_ON_PEER_LOSS=mask in sidecar mode)"
        )
    number, members = view
    if rank in members:
        raise PreconditionFailed(
            f"update_mask(rank={rank}) in EP group {name}: vLLM names EP rank {rank} dead, "
            f"but the committed view {number} still counts it a member (members "
            f"{list(members)}): the sidecar masks a rank only once it saw it leave (its "
            "session closed, its node's lease expired, its watcher silent past the bound) or "
            "an operator drained it (ExcludeRanks); a suspicion never evicts a live rank"
        )
