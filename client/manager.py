"""``WorkspaceManager``: a drop-in for every generation of vLLM's ``FlashInferNVLinkOneSidedManager``.

It takes the ``initialize()`` arguments of vLLM PR #42976, 0.30 and 0.33
(:mod:`moe_sidecar.client.vllm_sizing`) and offers what each generation's
callers read: ``moe_alltoall`` (FlashInfer's ``MoeAlltoAll``),
``combine_into()``, ``get_communication()`` (FlashInfer's
``flashinfer.moe_ep.NVLinkOneSidedAlltoAll`` over the same workspace),
``workspace_size``, ``initialized``, ``checkpoint_prepare/restore()``,
``get_handle()``, ``cleanup()``, ``rank`` and ``world_size``.
:mod:`moe_sidecar.client.vllm` makes a subclass of vLLM's own class from it.

Each ``initialize()`` of an MoE layer:

1. size the layer as capacities, with that generation's rule, and
   propose it (one RPC to the node's sidecar, or the in-process core in
   embedded mode); the answer is a decision: BUILD, REUSE or REBUILD and a plan;
2. when the EP group spans more ranks than one decider sees (``ep_size >
   local_ranks``), and always in embedded mode, agree across the EP group with
   one all-gather on ``cpu_group`` (:mod:`moe_sidecar.client.agreement`): the
   plans are folded with the core's join, and the actions the deciders gave
   by what they ask (a build any of them asked for is every rank's);
   otherwise the manager executes the action it received, as it is. Either
   way it executes an action it was given, never one of its own: a REUSE
   of a plan it does not hold is refused as an internal error;
3. BUILD/REBUILD: build through the backend at the plan's capacities (the
   backend's size function turns them into bytes), pass a barrier on
   ``cpu_group`` (never the world: pipeline stages rebuild a different
   number of times), release the superseded workspace (and destroy the
   ``moe_ep`` object made over it), and commit the plan now held.

A round whose layer the built plan already covers (a *covered round*) does
not wait where it needs no answer to go on: :mod:`moe_sidecar.client.covered`
says how, and when the answers are read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from moe_sidecar.client import naming
from moe_sidecar.client.agreement import LocalOutcome
from moe_sidecar.client.backends import AlltoAll, AlltoAllBackend, BuildSpec
from moe_sidecar.client.backends.communicator import GroupCommunicator
from moe_sidecar.client.construction import backend_named
from moe_sidecar.client.counters import ManagerCounters
from moe_sidecar.client.covered import check_reuse, passes_as_covered
from moe_sidecar.client.dispatch_layouts import DispatchLayouts
from moe_sidecar.client.errors import BackendError, InternalError, InvalidArgument
from moe_sidecar.client.first_round import share_proof_in_view
from moe_sidecar.client.group_collectives import GroupCollectives
from moe_sidecar.client.transport import Transport, transport_for
from moe_sidecar.client.vllm_sizing import UNSET, LayerCall, classify_call
from moe_sidecar.core.group import CommitRecord, Decision, Proposal, Requirement
from moe_sidecar.core.identity import new_group_secret, new_lifetime_secret
from moe_sidecar.core.plan import Action, Plan
from moe_sidecar.core.policy import validate_group_name
from moe_sidecar.core.policy.arrivals import Arrival

__all__ = ["DEFAULT_MAX_UNANSWERED", "ManagerCounters", "WorkspaceManager"]

DEFAULT_MAX_UNANSWERED = 256
"""Most covered rounds a rank leaves unanswered. Enough for a whole model's
layers, so a rank never waits on the slowest peer mid-model; small enough
that the answers (about 100 bytes each) fit the session stream's HTTP/2
flow-control window (64 KiB), past which the sidecar could not send them."""

_log = logging.getLogger(__name__)


class WorkspaceManager:
    """Sizes, builds, grows and frees one EP group's MoE all-to-all workspace.

    Drop-in for every generation of vLLM's ``FlashInferNVLinkOneSidedManager``:
    constructed as vLLM does (``WorkspaceManager(cpu_group)``), it takes each
    generation's ``initialize()`` arguments, sized by that generation's rule
    (:func:`moe_sidecar.client.vllm_sizing.classify_call`), and has the
    attributes and methods their callers read (``initialized``,
    ``moe_alltoall``, ``workspace_size``, ``max_num_tokens``, ``top_k``,
    ``num_experts``, ``rank``, ``world_size``, ``combine_into()``,
    ``get_communication()``, ``get_handle()``, ``checkpoint_prepare()``,
    ``checkpoint_restore()``, ``cleanup()``, ``destroy()``), plus
    ``generation`` (of the plan built) and ``counters``.

    Args:
        cpu_group: the EP group's CPU (gloo) process group; ``ep_size`` and
            ``ep_rank`` are its size and this process's rank in it. Every
            collective of the manager runs on it and on nothing wider.
        group: the EP group's name on the sidecar: model identity + parallel
            layout + pipeline stage, e.g. ``"deepseek-v3:fp4/tp1-ep8/pp0"``.
            None: ``MOE_SIDECAR_GROUP``, else derived from vLLM's config
            inside vLLM, else (embedded mode only) from the group's global
            ranks (:mod:`moe_sidecar.client.naming`).
        target: the sidecar's address (``unix:///run/moe-sidecar/sidecar.sock``
            or ``127.0.0.1:50051``). ``None`` reads ``MOE_SIDECAR_TARGET``;
            unset or empty (or ``"embedded"``) means embedded mode.
        backend: ``"flashinfer"`` (GPU: FlashInfer 0.7.2.post1's ``MoeAlltoAll``
            or 0.7.4's ``moe_ep`` object, from the installed release; name
            ``"flashinfer-moe-alltoall"`` or ``"flashinfer-moe-ep"`` to choose),
            ``"reference"`` (the CPU copy of its contract over gloo), or an
            object implementing :class:`moe_sidecar.client.backends.AlltoAllBackend`.
            None reads ``MOE_SIDECAR_BACKEND``, else ``"flashinfer"``.
        local_ranks: how many ranks of this EP group run on this node (i.e.
            talk to the same sidecar). Default: env ``MOE_SIDECAR_LOCAL_RANKS``,
            else counted once at construction by exchanging hostnames on
            ``cpu_group``. Ignored in embedded mode, where every rank decides
            alone. When it is below ``ep_size`` every round adds one all-gather.
        propose_timeout: seconds one Propose may wait for its round; must
            exceed the sidecar's ``--round-timeout``. Default: env
            ``MOE_SIDECAR_PROPOSE_TIMEOUT``, else 120.
        max_unanswered: most covered rounds left unanswered at once
            (:data:`DEFAULT_MAX_UNANSWERED`); past it a covered round reads
            the oldest answer first.

    Raises:
        InvalidArgument: no group name in sidecar mode (see ``group``), a bad
            group name, ``local_ranks`` outside ``[1, ep_size]``,
            ``max_unanswered`` below 1, or an unknown backend name (naming
            ``MOE_SIDECAR_BACKEND`` when it came from there).
        ValueError: an unknown backend name passed as ``backend``.
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
        if max_unanswered < 1:
            raise InvalidArgument.of("max_unanswered", max_unanswered, "must be at least 1")
        self.max_unanswered = max_unanswered
        self.cpu_group = cpu_group
        self.ep_size = dist.get_world_size(cpu_group)
        self.ep_rank = dist.get_rank(cpu_group)
        # vLLM's All2AllManagerBase names them so.
        self.rank = self.ep_rank
        self.world_size = self.ep_size
        self._transport: Transport = transport_for(target, propose_timeout=propose_timeout)
        self.group = naming.resolve(
            group,
            cpu_group,
            dist.get_process_group_ranks(cpu_group),
            embedded=self._transport.embedded,
        )
        validate_group_name(self.group)
        self._on_group = GroupCollectives(cpu_group, self.group, self._transport)
        self.local_ranks = (
            1 if self._transport.embedded else self._on_group.local_ranks(local_ranks)
        )
        self.backend: AlltoAllBackend = backend_named(backend, cpu_group)
        self.lifetime = new_lifetime_secret()
        """This process lifetime's secret token; the sidecar keeps only its digest."""
        self._group_proof: str | None = None
        """The group's proof for this lifetime (shared at its first initialize())."""
        self._round = 0
        """Round of the current lifetime (the n-th initialize() since it began)."""
        self._initializes = 0
        self._builds = 0
        self._rebuilds = 0
        self._reuses = 0
        self._covered = 0
        self._unagreed = 0
        """Embedded: rounds passed as covered since the last agreement."""
        self._last_layer = ""
        self._releases = 0
        self._first_build_seconds: float | None = None

        self._communication: Any = None
        """The moe_ep object over ``moe_alltoall``, made on first use."""
        self._layouts = DispatchLayouts()
        """What ``get_communication().params`` describes."""
        self.last_call: LayerCall | None = None
        """The latest ``initialize()`` call understood: its vLLM generation,
        capacities and dispatch row."""

        self.generation = 0
        self._set_built(None, None)

    # --- what is built -----------------------------------------------------

    @property
    def embedded(self) -> bool:
        """True when the decision core runs in this process (no sidecar)."""
        return self._transport.embedded

    @property
    def agrees_across_ranks(self) -> bool:
        """True when every round adds the cross-rank all-gather."""
        return self._transport.embedded or self.ep_size > self.local_ranks

    @property
    def plan(self) -> Plan | None:
        """The plan the current all-to-all was built at (None: nothing built)."""
        return self._built

    @property
    def counters(self) -> ManagerCounters:
        """A snapshot of what this manager has done."""
        return ManagerCounters(
            rounds=self._initializes,
            builds=self._builds,
            rebuilds=self._rebuilds,
            reuses=self._reuses,
            releases=self._releases,
            rpcs=self._transport.rpc_count,
            covered=self._covered,
            collectives=self._on_group.count,
            first_build_seconds=self._first_build_seconds,
            jit_compiled=getattr(self.backend, "jit_compiled", None),
        )

    @property
    def moe_alltoall(self) -> AlltoAll | None:
        """The all-to-all built (FlashInfer's ``MoeAlltoAll``; None: nothing
        built), once every answer still outstanding has been read
        (see :meth:`_settle`).

        Raises:
            CoordinatorError: a covered round was refused (naming its layers
                and ranks).
            BackendError: a build an answer asked for failed.
        """
        self._settle()
        return self._alltoall

    def _set_built(self, handle: AlltoAll | None, plan: Plan | None) -> None:
        """Holds ``handle``, built at ``plan`` (None, None: nothing), and the
        attributes vLLM's callers read of it."""
        self._alltoall: AlltoAll | None = handle
        self._built: Plan | None = plan
        self.initialized = handle is not None
        self.workspace_size = (
            self.backend.workspace_bytes(plan.capacities, self.ep_size) if plan else 0
        )
        self.max_num_tokens = plan.capacities.max_tokens if plan else 0
        self.top_k = plan.capacities.top_k if plan else 0
        self.num_experts = plan.capacities.num_experts if plan else 0
        if plan is not None:
            self.generation = plan.generation

    # --- the round ---------------------------------------------------------

    def _share_group_proof(self) -> None:
        """At a lifetime's first initialize(), before any proposal: the EP
        group's ranks share one secret (rank 0 draws it) that every proposal
        and commit of the lifetime carries, so the sidecar can tell the
        group's ranks from any other process (one collective per lifetime;
        none in embedded mode, where the core is this process's own, nor for a
        group of one rank, which draws it alone). Meanwhile the rank's
        arrival waits at the sidecar, which shows it and ends the wait at its
        round timeout (:mod:`moe_sidecar.client.first_round`)."""
        if self._group_proof is not None:
            return
        if self.embedded:
            self._group_proof = ""
            return
        if self.ep_size == 1:
            self._group_proof = new_group_secret()
            return
        # Shared while the sidecar sees this rank arrived (bounded by its round timeout).
        arrival = Arrival(self.group, self.ep_size, self.ep_rank, self.local_ranks, self.lifetime)
        target = getattr(self._transport, "target", "")
        self._group_proof = share_proof_in_view(self._on_group, self._transport, arrival, target)

    def _proposal(self, requirement: Requirement) -> Proposal:
        return Proposal(
            group=self.group,
            ep_size=self.ep_size,
            ep_rank=self.ep_rank,
            local_ranks=self.local_ranks,
            lifetime=self.lifetime,
            round=self._round,
            requirement=requirement,
            proof=self._group_proof or "",
        )

    def _propose(self, requirement: Requirement) -> Decision:
        return self._transport.propose(self._proposal(requirement))

    def _passes_as_covered(self, call: LayerCall) -> bool:
        # Embedded mode always agrees across ranks, yet passes covered rounds:
        # its next agreement checks them (see moe_sidecar.client.covered).
        mode_allows = self.embedded or not self.agrees_across_ranks
        return passes_as_covered(call.capacities, self._built, mode_allows)

    def _settle(self, keep: int = 0) -> None:
        """Reads the answers still outstanding until at most ``keep`` remain,
        builds what they ask, and commits the plan held after a build
        (:meth:`_read_answers`). Embedded: agrees once on what is held after
        rounds passed as covered.

        Raises:
            CoordinatorError: an answer is a refusal (naming the round's
                layers and ranks), the commit was refused, or the sidecar
                could not be reached.
            InternalError: a REUSE of a plan this rank does not hold.
            BackendError: a build an answer asked for failed.
            AgreementError: embedded, the ranks passed different rounds as covered.
        """
        # Every forward step reads moe_alltoall and every covered round comes
        # here: most of the time there is nothing to settle.
        if not self._unagreed and self._transport.unanswered <= keep:
            return
        if self.embedded:
            self._agree_on_held()
            return
        self._read_answers(keep)

    def _read_answers(self, keep: int) -> None:
        """Reads the answers still outstanding, oldest first, until at most
        ``keep`` remain, and does what they ask.

        A REUSE needs nothing but the check that this rank holds its plan. A
        refusal is raised. A BUILD/REBUILD (the sidecar's plan rose above what
        was built while this rank passed the round as covered) is built here:
        every rank of that round got the same decision and builds it, at once
        or when it reads it, so the build's collectives meet. Then every
        answer still outstanding is read (more builds if they ask for them),
        and the plan held is committed against the latest round answered:
        every message sent before the commit has been answered, so that round
        is the sidecar's latest closed one (still retained), decided at the
        plan held.

        Raises:
            CoordinatorError: an answer is a refusal (naming the round's layers
                and ranks), the commit was refused, or the sidecar could not
                be reached.
            InternalError: a REUSE of a plan this rank does not hold.
            BackendError: a build an answer asked for failed.
        """
        build_seconds: float | None = None
        answered = 0  # the latest round answered
        while self._transport.unanswered > (0 if build_seconds is not None else keep):
            decision = self._transport.next_answer()
            answered = decision.round
            if decision.action is Action.REUSE:
                self._check_reuse(decision.round, decision.layer, decision.plan)
                continue
            _log.info(
                "group %s round %d (%s): %s asked for after this rank passed the round as "
                "covered (the sidecar's plan is above what was built)",
                self.group,
                decision.round,
                decision.layer,
                decision.action.value,
            )
            build_seconds = self._build(
                decision.plan, decision.action, decision.layer, decision.round
            )
        if build_seconds is not None and self._built is not None:
            self._commit(answered, self._built, build_seconds)

    def _agree_on_held(self) -> None:
        """Embedded: one agreement on what is held, after rounds passed as
        covered; it finds ranks out of step (see :mod:`moe_sidecar.client.agreement`).

        Raises:
            AgreementError: the ranks passed different rounds as covered.
            RankLost: a peer died in the all-gather.
            InternalError: the ranks hold different plans.
        """
        held = self._built
        self._unagreed = 0
        _, agreed = self._on_group.agree(
            LocalOutcome(
                ep_rank=self.ep_rank,
                layer=self._last_layer,
                plan=held,
                round=self._round,
                settling=True,
            )
        )
        if held is None or not held.covers(agreed.capacities):
            raise InternalError(
                f"EP group {self.group!r} after round {self._round}: this rank holds {held} but "
                f"the ranks' plans join to {agreed}; restart the ranks"
            )

    def _check_reuse(self, round_number: int, layer: str, plan: Plan) -> None:
        check_reuse(self.group, round_number, layer, plan, self._built)

    def _propose_covered(self, call: LayerCall, layer: str) -> None:
        """A covered round: sends the proposal and goes on (at most
        ``max_unanswered`` answers outstanding)."""
        self._settle(keep=self.max_unanswered - 1)
        self._round += 1
        self._transport.propose_later(
            self._proposal(Requirement(capacities=call.capacities, layer=layer))
        )
        self._passed_as_covered(call)

    def _passed_as_covered(self, call: LayerCall) -> None:
        """Counts a round passed as covered (a reuse, unless its answer later
        asks for a build) and keeps its call."""
        self._covered += 1
        self._reuses += 1
        self._remember(call)

    def _decide(
        self,
        layer: str,
        decision: Decision | None,
        failure: BaseException | None,
        round_number: int,
    ) -> tuple[Action, Plan]:
        """The action and plan of this round, from the decision received.

        A group one decider sees whole executes the decision as it came. A
        group agreed across deciders (nodes, or embedded ranks) executes the
        agreed one: the join of every rank's plan, with the action that asks
        most among those the deciders gave.
        """
        if self.agrees_across_ranks:
            self._unagreed = 0
            action, plan = self._on_group.agree(
                LocalOutcome(
                    ep_rank=self.ep_rank,
                    layer=layer,
                    plan=decision.plan if decision is not None else None,
                    failure=failure,
                    round=round_number,
                    action=decision.action if decision is not None else Action.REUSE,
                )
            )
        else:
            assert decision is not None  # a failure is raised unless agreed across ranks
            action, plan = decision.action, decision.plan
        if action is Action.REUSE:
            self._check_reuse(round_number, layer, plan)
        return action, plan

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
        :func:`moe_sidecar.client.vllm_sizing.classify_call`):

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
            RoundTimedOut: a local rank never proposed this round; the message
                names it and the last layer it reported.
            RoundAborted: another rank of the group restarted mid-round
                (:class:`~moe_sidecar.client.errors.RankLost` when a rank died
                while the group's proof was shared at a lifetime's first call).
            PermissionDenied: the sidecar refused this rank's group proof
                (another process holds the rank's place with the proof most
                of the group's ranks hold).
            CoordinatorUnavailable: the sidecar could not be reached.
            BackendError: the backend could not build.
        """
        self._share_group_proof()
        self._initializes += 1
        failure: BaseException | None = None
        decision: Decision | None = None
        call: LayerCall | None = None
        # The round this call is, proposed or not: a failed call joins the
        # agreement of the round its peers are in.
        this_round = self._round + 1
        self._last_layer = layer
        try:
            call = classify_call(
                self.ep_size,
                max_num_tokens,
                top_k,
                num_experts,
                hidden_size,
                payload,
                {
                    "dispatch_dtype_bytes_per_elem": dispatch_dtype_bytes_per_elem,
                    "dispatch_scale_bytes_per_token": dispatch_scale_bytes_per_token,
                    "x_bytes_per_token": x_bytes_per_token,
                    "x_sf_bytes_per_token": x_sf_bytes_per_token,
                    "dispatch_format": dispatch_format,
                    "extra_payload_bytes_per_token": extra_payload_bytes_per_token,
                },
            )
            covered = self._passes_as_covered(call)
            if covered and not self.embedded:
                self._propose_covered(call, layer)
                return
            if not self.embedded:
                # A round that waits reads every earlier answer first (and
                # does what they ask), so it decides on top of what they built.
                # (Embedded: this round's agreement checks the earlier ones.)
                self._settle()
            # A refused call proposes nothing, so it uses up no round: the
            # caller may correct it and go on.
            self._round += 1
            decision = self._propose(Requirement(capacities=call.capacities, layer=layer))
            if covered and decision.action is Action.REUSE:
                self._pass_embedded_covered(call)
                return
        except Exception as error:
            if not self.agrees_across_ranks:
                raise
            # Still join the agreement, so the other ranks raise too instead
            # of waiting for this one forever.
            failure = error
        action, plan = self._decide(layer, decision, failure, this_round)
        assert call is not None  # a failure raised in _decide
        self._execute(call, action, plan, layer)

    def _pass_embedded_covered(self, call: LayerCall) -> None:
        """Embedded: the rank's own core agrees on a covered round; the next
        agreement checks that every rank passed the same rounds."""
        self._unagreed += 1
        self._passed_as_covered(call)

    def _execute(self, call: LayerCall, action: Action, plan: Plan, layer: str) -> None:
        """Does what the round decided: keeps what is built, or builds ``plan``
        and commits it.

        Raises:
            BackendError: the backend could not build.
            RankLost: a peer died in the post-build barrier.
            CoordinatorError: the commit was refused or could not be sent.
        """
        self._remember(call)
        if action is Action.REUSE:
            self._reuses += 1
            _log.debug("group %s round %d (%s): reuse %s", self.group, self._round, layer, plan)
            return
        build_seconds = self._build(plan, action, layer, self._round)
        self._commit(self._round, plan, build_seconds)

    def _remember(self, call: LayerCall) -> None:
        """Keeps the call and its dispatch row (for the moe_ep object's description)."""
        self.last_call = call
        self._layouts.remember(call.layout)

    def _commit(self, round_number: int, plan: Plan, build_seconds: float) -> None:
        self._transport.commit(
            self.group,
            CommitRecord(
                ep_rank=self.ep_rank,
                lifetime=self.lifetime,
                round=round_number,
                plan=plan,
                build_seconds=build_seconds,
                proof=self._group_proof or "",
            ),
        )

    def _build(self, plan: Plan, action: Action, layer: str, round_number: int) -> float:
        """Builds ``plan`` (decided in round ``round_number``), passes the EP
        barrier and releases the superseded workspace; returns the build's
        seconds. The caller commits.

        Raises:
            BackendError: the backend could not build.
            RankLost: a peer died in the barrier.
        """
        workspace = self.backend.workspace_bytes(plan.capacities, self.ep_size)
        spec = BuildSpec(
            ep_size=self.ep_size,
            ep_rank=self.ep_rank,
            capacities=plan.capacities,
            workspace_size_per_rank=workspace,
        )
        started = time.perf_counter()
        handle = self.backend.build(spec)
        build_seconds = time.perf_counter() - started
        if self._first_build_seconds is None:
            self._first_build_seconds = build_seconds
        self._on_group.barrier_after_build(self.backend, handle)
        superseded = self._alltoall
        self._drop_communication()
        self._set_built(handle, plan)
        if superseded is not None:
            self.backend.release(superseded)
            self._releases += 1
        if action is Action.BUILD:
            self._builds += 1
        else:
            self._rebuilds += 1
        _log.info(
            "group %s round %d (%s): %s at %d bytes/rank, %d tokens, generation %d (%.3fs)",
            self.group,
            round_number,
            layer,
            action.value,
            workspace,
            plan.capacities.max_tokens,
            plan.generation,
            build_seconds,
        )
        return build_seconds

    # --- vLLM's surface ----------------------------------------------------

    def get_handle(self, kwargs: object) -> WorkspaceManager:
        """Returns the manager itself, as vLLM's manager does."""
        return self

    def get_communication(self) -> Any:
        """FlashInfer's ``flashinfer.moe_ep.NVLinkOneSidedAlltoAll`` over the
        current workspace (the reference copy of it with
        ``backend="reference"``): what vLLM 0.33's prepare/finalize calls
        ``dispatch``/``combine`` on at every step.

        Made on first use after each build, from the ``moe_alltoall`` built
        (no allocation, no collective); a new object only after the
        workspace grew (the superseded one is destroyed, its ``alltoall``
        raises). ``params.max_tokens_per_rank`` and ``params.hidden_size``
        are the plan's; ``params.dispatch_format`` is the widest dispatch row
        a layer of that hidden size asked for and
        ``config.extra_payload_bytes_per_token`` the rest of the plan's
        dispatch bytes. Shapes: see :meth:`ReferenceCommunication.dispatch`.

        Every answer still outstanding is read first (:meth:`_settle`).

        Raises:
            BackendError: nothing is built, or the backend cannot make the
                object (e.g. FlashInfer without ``moe_ep``).
            CoordinatorError: a covered round was refused (naming its layers
                and ranks).
        """
        handle, plan = self.moe_alltoall, self._built  # reads every outstanding answer
        if handle is None or plan is None:
            raise BackendError("get_communication() before initialize(): nothing is built")
        if self._communication is None:
            self._communication = self.backend.communication(
                handle, self._layouts.communication_spec(plan, self.ep_size, self.ep_rank)
            )
        return self._communication

    @property
    def communication(self) -> Any:
        """:meth:`get_communication`, or None when nothing is built (vLLM 0.33's attribute)."""
        return None if self.moe_alltoall is None else self.get_communication()

    def _drop_communication(self) -> None:
        communication, self._communication = self._communication, None
        # FlashInfer 0.7.4's object is the handle itself: the release destroys it.
        if communication is not None and communication is not self.moe_alltoall:
            communication.destroy()

    def checkpoint_prepare(self) -> None:
        """Unmaps the workspace for a checkpoint (vLLM's sleep mode); collective
        over the EP group. Nothing built: nothing to do.

        Raises:
            RuntimeError: FlashInfer's: a dispatch is waiting for its combine.
        """
        handle = self.moe_alltoall
        if handle is not None:
            handle.checkpoint_prepare()

    def checkpoint_restore(self) -> None:
        """Maps the workspace again after :meth:`checkpoint_prepare`, exchanging
        the memory handles on the EP group's CPU group; collective.

        Raises:
            RuntimeError: FlashInfer's: the group differs from the allocation's.
        """
        handle = self.moe_alltoall
        if handle is not None:
            handle.checkpoint_restore(GroupCommunicator(self.cpu_group))

    def combine_into(
        self, payload: torch.Tensor, runtime_max_tokens_per_rank: int, output: torch.Tensor
    ) -> torch.Tensor:
        """Combines ``payload`` into the caller's ``output`` tensor.

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

    def cleanup(self) -> None:
        """Frees the current workspace and closes the sidecar channel.

        Every answer still outstanding is read first, so closing the session
        never fails a round a peer has yet to propose; otherwise local: no
        collective (unless such an answer asks for a build every rank of
        its round joins), so it is safe in teardown paths where peers may
        already be gone; call it on every rank only when none uses the
        all-to-all any more. A later ``initialize()`` starts a new lifetime
        (every rank must clean up before) and builds afresh.

        Raises:
            CoordinatorError: a covered round was refused (naming its layers
                and ranks); raised after freeing and closing.
            BackendError: a build an outstanding answer asked for failed
                (raised after freeing and closing).
        """
        unsettled: Exception | None = None
        self._unagreed = 0  # embedded: cleanup agrees on nothing
        try:
            self._settle()
        except Exception as error:
            unsettled = error
        handle = self._alltoall
        self._drop_communication()
        self._set_built(None, None)
        if handle is not None:
            self.backend.release(handle)
            self._releases += 1
        self._transport.close()
        self.lifetime = new_lifetime_secret()
        self._group_proof = None
        self._round = 0
        if unsettled is not None:
            raise unsettled

    def destroy(self) -> None:
        """What vLLM calls when it tears its communicator down
        (``CudaCommunicator.destroy``): :meth:`cleanup`, so the workspace is
        freed rather than kept until the process ends."""
        self.cleanup()
