"""``WorkspaceManager``: a drop-in for every generation of vLLM's ``FlashInferNVLinkOneSidedManager``.

It takes the ``initialize()`` arguments of vLLM PR #42976, 0.30 and 0.33
(:mod:`moe_sidecar.client.engines.vllm.sizing`) and offers what each
generation's callers read: ``moe_alltoall`` (FlashInfer's ``MoeAlltoAll``),
``combine_into()``, ``get_communication()`` (FlashInfer's
``flashinfer.moe_ep.NVLinkOneSidedAlltoAll`` over the same workspace),
``workspace_size``, ``initialized``, ``checkpoint_prepare/restore()``,
``get_handle()``, ``cleanup()``, ``rank`` and ``world_size``.
:mod:`moe_sidecar.client.engines.vllm.plugin` makes a subclass of vLLM's own
class from it.

Why a subclass of the engine-neutral
:class:`~moe_sidecar.client.manager.AlltoAllManager` rather than a wrapper
around one: vLLM's callers read the manager's own attributes and methods
(and the plugin puts this class in vLLM's class's place, before it in the
method resolution order), so every method of the round protocol
(``get_communication()``, the checkpoints, ``cleanup()``) must be this
object's; a wrapper would forward each of them. What the subclass adds is
only vLLM's: its three ``initialize()`` call forms, understood by vLLM's
sizing and run as one round of :meth:`AlltoAllManager.initialize_layer_from`,
the attributes vLLM reads, vLLM's group naming and combine setting
(:data:`VLLM_RULES`), and the methods only vLLM calls.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from moe_sidecar.client.backends import AlltoAllBackend
from moe_sidecar.client.engine_rules import EngineRules
from moe_sidecar.client.engines.vllm.fault_tolerance import (
    FaultToleranceUnsupported,
    VllmFaultTolerance,
    check_update_mask,
    masked_flags,
    supports_fault_tolerance,
)
from moe_sidecar.client.engines.vllm.naming import vllm_group_name_of
from moe_sidecar.client.engines.vllm.settings import low_precision_combine
from moe_sidecar.client.engines.vllm.sizing import UNSET, LayerCall, classify_call
from moe_sidecar.client.errors import BackendError
from moe_sidecar.client.layer_need import LayerNeed
from moe_sidecar.client.manager import DEFAULT_MAX_UNANSWERED, AlltoAllManager
from moe_sidecar.client.membership_view import AdoptedView

__all__ = ["VLLM_RULES", "WorkspaceManager"]

_log = logging.getLogger(__name__)

VLLM_RULES = EngineRules(group_name=vllm_group_name_of, low_precision_combine=low_precision_combine)
"""vLLM's rules: the group named from vLLM's config
(:mod:`moe_sidecar.client.engines.vllm.naming`), FP8 combine by vLLM's own
``VLLM_FLASHINFER_MOE_A2A_LOW_PRECISION_COMBINE``."""


class WorkspaceManager(AlltoAllManager):
    """Sizes, builds, grows and frees one EP group's MoE all-to-all workspace.

    Drop-in for every generation of vLLM's ``FlashInferNVLinkOneSidedManager``:
    constructed as vLLM does (``WorkspaceManager(cpu_group)``), it takes each
    generation's ``initialize()`` arguments, sized by that generation's rule
    (:func:`moe_sidecar.client.engines.vllm.sizing.classify_call`), and has the
    attributes and methods their callers read (``initialized``,
    ``moe_alltoall``, ``workspace_size``, ``max_num_tokens``, ``top_k``,
    ``num_experts``, ``rank``, ``world_size``, ``combine_into()``,
    ``get_communication()``, ``get_handle()``, ``checkpoint_prepare()``,
    ``checkpoint_restore()``, ``cleanup()``, ``destroy()``), vLLM 0.33's
    fault-tolerance hooks (``support_fault_tolerance``, ``query_fault()``,
    ``query_active_mask()``, ``clean_buffers()``, and vLLM 0.34's
    ``update_mask()``:
    :mod:`moe_sidecar.client.engines.vllm.fault_tolerance`), plus
    ``generation`` (of the plan built) and ``counters``.

    Args:
        cpu_group, group, target, backend, local_ranks, propose_timeout,
        max_unanswered: as :class:`~moe_sidecar.client.manager.AlltoAllManager`'s;
            without ``group`` or ``MOE_SIDECAR_GROUP``, inside vLLM the group is
            named from vLLM's config.

    Raises:
        InvalidArgument: no group name in sidecar mode, a bad group name,
            ``local_ranks`` outside ``[1, ep_size]``, ``max_unanswered`` below
            1, or an unknown backend name (naming ``MOE_SIDECAR_BACKEND`` when
            it came from there).
        ValueError: an unknown backend name passed as ``backend``.
        FaultToleranceUnsupported: vLLM's fault tolerance is on with
            ``MOE_SIDECAR_ON_PEER_LOSS=mask`` but CUDA graphs are on and the
            backend's masked all-to-all refuses their capture.
    """

    def __init__(
        self,
        cpu_group: dist.ProcessGroup,
        group: str | None = None,
        target: str | None = None,
        backend: str | AlltoAllBackend | None = None,
        *,
        local_ranks: int | None = None,
        propose_timeout: float | None = None,
        max_unanswered: int = DEFAULT_MAX_UNANSWERED,
    ) -> None:
        self.last_call: LayerCall | None = None
        """The latest ``initialize()`` call understood: its vLLM generation,
        capacities and dispatch row."""
        super().__init__(
            cpu_group,
            group,
            target,
            backend,
            local_ranks=local_ranks,
            propose_timeout=propose_timeout,
            max_unanswered=max_unanswered,
            engine=VLLM_RULES,
        )
        # vLLM's All2AllManagerBase names them so.
        self.rank = self.ep_rank
        self.world_size = self.ep_size
        try:
            support = supports_fault_tolerance(
                VllmFaultTolerance.current(),
                masking=self._views.masking,
                sidecar=not self.embedded,
                backend=self.backend.name,
            )
        except FaultToleranceUnsupported:
            self.cleanup()  # the session opened above is closed before vLLM stops
            raise
        self.support_fault_tolerance = support
        """vLLM 0.33 reads it once: whether to call :meth:`query_fault` after every
        step (its fault tolerance on, ``MOE_SIDECAR_ON_PEER_LOSS=mask`` in sidecar
        mode, and no CUDA graphs where the backend's mask refuses them)."""

    def _held_changed(self) -> None:
        """Keeps the attributes vLLM's callers read of what is built."""
        super()._held_changed()
        capacities = None if self.plan is None else self.plan.capacities
        self.initialized = capacities is not None
        self.workspace_size = self.workspace_bytes
        self.max_num_tokens = capacities.max_tokens if capacities else 0
        self.top_k = capacities.top_k if capacities else 0
        self.num_experts = capacities.num_experts if capacities else 0

    def initialize(
        self,
        max_num_tokens: int,
        top_k: int,
        num_experts: int,
        hidden_size: int,
        *payload: object,
        layer: str = "",
        dispatch_dtype_bytes_per_elem: object = UNSET,
        dispatch_scale_bytes_per_token: object = UNSET,
        x_bytes_per_token: object = UNSET,
        x_sf_bytes_per_token: object = UNSET,
        dispatch_format: object = UNSET,
        extra_payload_bytes_per_token: object = UNSET,
    ) -> None:
        """Makes the all-to-all serve this MoE layer; one round of the protocol.

        Every rank of the EP group calls it for the same layers in the same
        order. Afterwards ``moe_alltoall`` (and ``get_communication()``)
        serves this layer and every layer initialized before it in this
        process; it is a new object only when the workspace had to grow.

        The layer's dispatch row comes as one vLLM generation's pair, by
        keyword or positionally after ``hidden_size`` (the rules:
        :func:`moe_sidecar.client.engines.vllm.sizing.classify_call`):

        * vLLM 0.33: ``dispatch_format`` (a FlashInfer ``QuantFormat``, its
          name, or None for bf16 rows; the default) and
          ``extra_payload_bytes_per_token`` (default 0);
        * vLLM 0.30: ``x_bytes_per_token`` (bytes of the dispatched hidden
          states: ``hidden/2`` for NVFP4, ``hidden*2`` for bf16) and
          ``x_sf_bytes_per_token`` (their scales: ``hidden/16`` for NVFP4);
        * PR #42976: ``dispatch_dtype_bytes_per_elem`` (0 NVFP4, 1 FP8, 2
          bf16) and ``dispatch_scale_bytes_per_token``.

        Args:
            max_num_tokens: most tokens this rank dispatches in one call.
            top_k: experts per token.
            num_experts: experts of the layer, over all ranks.
            hidden_size: hidden dimension (the combine payload is bf16).
            layer: a label for the layer (e.g. ``"model.layers.61.mlp"``),
                used in errors and the sidecar's history.

        Raises:
            InvalidArgument: an argument out of range, a value no generation
                accepts, or two generations' keywords in one call; the
                message names the argument and the keyword probably meant.
            PreconditionFailed: another ``top_k``/``num_experts`` than earlier
                layers, or ranks disagreeing on the layer (an
                :class:`~moe_sidecar.client.errors.AgreementError` when the
                cross-rank agreement found it); the message names ranks and layers.
            RoundTimedOut, RoundAborted, PermissionDenied,
            CoordinatorUnavailable, BackendError: see
                :meth:`~moe_sidecar.client.manager.AlltoAllManager.initialize_layer`.
        """
        keywords = {
            "dispatch_dtype_bytes_per_elem": dispatch_dtype_bytes_per_elem,
            "dispatch_scale_bytes_per_token": dispatch_scale_bytes_per_token,
            "x_bytes_per_token": x_bytes_per_token,
            "x_sf_bytes_per_token": x_sf_bytes_per_token,
            "dispatch_format": dispatch_format,
            "extra_payload_bytes_per_token": extra_payload_bytes_per_token,
        }

        def understand() -> LayerNeed:
            call = classify_call(
                self.ep_size, max_num_tokens, top_k, num_experts, hidden_size, payload, keywords
            )
            self.last_call = call
            return LayerNeed(capacities=call.capacities, layout=call.layout, layer=layer)

        self.initialize_layer_from(understand, layer)

    # --- what only vLLM calls ----------------------------------------------

    def get_handle(self, kwargs: object) -> WorkspaceManager:
        """Returns the manager itself, as vLLM's manager does."""
        return self

    @property
    def communication(self) -> Any:
        """:meth:`get_communication`, or None when nothing is built (vLLM 0.33's attribute)."""
        return None if self.moe_alltoall is None else self.get_communication()

    def combine_into(
        self, payload: torch.Tensor, runtime_max_tokens_per_rank: int, output: torch.Tensor
    ) -> torch.Tensor:
        """Combines ``payload`` into the caller's ``output`` tensor (vLLM 0.30's call).

        ``output`` is ``[local_num_tokens, hidden]`` of the payload's dtype
        (contiguous; on the GPU with FlashInfer). Returns ``output``.

        Raises:
            BackendError: nothing is built.
            RuntimeError: the backend's (FlashInfer's) own checks.
        """
        handle = self.moe_alltoall
        if handle is None:
            raise BackendError("combine_into() before initialize(): nothing is built")
        return handle.combine(payload, runtime_max_tokens_per_rank, output=output)

    # --- vLLM 0.33's fault tolerance -----------------------------------------

    def query_fault(self) -> torch.Tensor:
        """A 0-dim bool CPU tensor: a peer of this lifetime died and no view was
        adopted since (:meth:`peer_fault`). Reads one attribute: no RPC, no
        device work (vLLM calls it after every step)."""
        return torch.tensor(self.peer_fault(), dtype=torch.bool)

    def query_active_mask(self) -> torch.Tensor:
        """An int32 CPU tensor of ``ep_size`` ranks in vLLM's convention: 0 live,
        1 masked (no member of the adopted view, or a peer whose death was heard
        of and no view masks yet). No RPC, no device work."""
        loss = self._peer_loss.fault  # the base class's watch: the death not yet masked
        lost = () if loss is None else (loss.ep_rank,)
        flags = masked_flags(self.active_mask(), self.ep_size, lost)
        return torch.tensor(flags, dtype=torch.int32)

    def clean_buffers(self) -> None:
        """vLLM's retry (``WorkerSentinel.retry``): adopts the group's committed
        view (:meth:`adopt_view`: acknowledges the proposed one at this
        quiesced point and waits for its commit; a committed view with this
        rank in it is adopted as it is), which clears the fault
        :meth:`query_fault` reports, and drops a dispatch a fault left
        without its combine. Nothing built, or fault tolerance not served
        (:attr:`support_fault_tolerance` False): nothing to do.

        Raises:
            ViewFailed: the view failed: every rank of the group restarts.
            RoundTimedOut: the view was not decided within the propose timeout.
            PreconditionFailed: this rank is no member of the view.
            CoordinatorError: a covered round was refused, or the sidecar
                could not be asked.
        """
        if self.plan is None or not self.support_fault_tolerance:
            return
        self._views.reset_steps()
        view: AdoptedView = self.adopt_view()
        _log.info(
            "moe-sidecar: vLLM retry: EP rank %d runs under view %d (members %s)",
            self.ep_rank,
            view.number,
            list(view.members),
        )

    @property
    def adopted_view(self) -> AdoptedView | None:
        """The membership view every step runs under (None: none adopted)."""
        return self._views.adopted

    def update_mask(self, rank: int, masked: bool = True) -> None:
        """vLLM 0.34's retry (and ``scale_down``, which runs it) after
        :meth:`clean_buffers`: EP rank ``rank`` is in vLLM's dead set. Accepted
        (nothing changes) when the view :meth:`clean_buffers` adopted already
        excludes it: every step already passes that view's mask. The view is
        the sidecar's; vLLM's word does not move it
        (:func:`~moe_sidecar.client.engines.vllm.fault_tolerance.check_update_mask`).

        Raises:
            InvalidArgument: ``rank`` outside ``[0, ep_size)``.
            PreconditionFailed: ``masked=False`` (a rank comes back through
                :meth:`rejoin`), no view adopted, or the adopted view still
                counts ``rank`` a member; the message names the rank and the view.
        """
        adopted = self.adopted_view
        view = None if adopted is None else (adopted.number, adopted.members)
        check_update_mask(self.group, rank, masked, self.ep_size, view)
        _log.info(
            "moe-sidecar: vLLM update_mask(%d): EP rank %d already masked by view %d",
            rank,
            rank,
            view[0] if view else 0,
        )

    def destroy(self) -> None:
        """What vLLM calls when it tears its communicator down
        (``CudaCommunicator.destroy``): :meth:`cleanup`, so the workspace is
        freed rather than kept until the process ends."""
        self.cleanup()
