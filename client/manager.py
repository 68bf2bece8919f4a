"""The engine-neutral manager: one EP group's all-to-all workspace, one round per layer.

:class:`AlltoAllManager` runs the round protocol for a layer's need, stated
as capacities (:class:`~moe_sidecar.client.layer_need.LayerNeed`), in no
engine's argument forms; an engine's room (:mod:`moe_sidecar.client.engines`)
turns its own ``initialize()`` into :meth:`AlltoAllManager.initialize_layer_from`
and adds the surface its callers read (vLLM's:
:class:`moe_sidecar.client.engines.vllm.manager.WorkspaceManager`).

Each round: (1) propose the layer's capacities (one RPC to the node's
sidecar, or the in-process core in embedded mode) and receive a decision,
BUILD, REUSE or REBUILD and a plan; (2) when the EP group spans more ranks
than one decider sees (``ep_size > local_ranks``), and always in embedded
mode, agree across the EP group with one all-gather on ``cpu_group``
(:mod:`moe_sidecar.client.agreement`: plans folded with the core's join, the
action that asks most); either way execute an action it was given, never one
of its own (a REUSE of a plan it does not hold is an internal error);
(3) BUILD/REBUILD: build through the backend at the plan's capacities, pass
a barrier on ``cpu_group`` (never the world: pipeline stages rebuild a
different number of times), release the superseded workspace and commit the
plan now held (:mod:`moe_sidecar.client.held_workspace`). A round whose layer
the built plan covers does not wait where it needs no answer
(:mod:`moe_sidecar.client.covered`). What a round executes, and the settling
of covered rounds, is worked out from the decisions received in
:mod:`moe_sidecar.client.round_decisions`. Every proposal is made in one
place, :meth:`AlltoAllManager._proposal`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch.distributed as dist

from moe_sidecar.client import naming
from moe_sidecar.client.backends import AlltoAll, AlltoAllBackend
from moe_sidecar.client.backends.communicator import GroupCommunicator
from moe_sidecar.client.construction import backend_named
from moe_sidecar.client.counters import ManagerCounters
from moe_sidecar.client.engine_rules import NO_ENGINE, EngineRules
from moe_sidecar.client.errors import BackendError, InvalidArgument, PreconditionFailed
from moe_sidecar.client.first_round import share_proof_in_view
from moe_sidecar.client.group_collectives import GroupCollectives
from moe_sidecar.client.held_workspace import HeldWorkspace
from moe_sidecar.client.layer_need import LayerNeed
from moe_sidecar.client.membership_view import AdoptedView, ViewFollower
from moe_sidecar.client.owner_key import owner_digest_of
from moe_sidecar.client.peer_loss import PeerLossPolicy, PeerLossWatch
from moe_sidecar.client.rejoin import rejoin_survivor
from moe_sidecar.client.round_decisions import RoundDecisions
from moe_sidecar.client.transport import DEFAULT_PROPOSE_TIMEOUT_S, Transport, transport_for
from moe_sidecar.core.defaults import ENV_ON_PEER_LOSS
from moe_sidecar.core.errors import quote_name
from moe_sidecar.core.group import CommitRecord, Decision, Proposal, Requirement
from moe_sidecar.core.identity import new_group_secret, new_lifetime_secret
from moe_sidecar.core.plan import Action, Plan
from moe_sidecar.core.policy import RETAINED_ROUNDS, validate_group_name
from moe_sidecar.core.policy.arrivals import Arrival

__all__ = ["DEFAULT_MAX_UNANSWERED", "AlltoAllManager", "ManagerCounters"]

DEFAULT_MAX_UNANSWERED = RETAINED_ROUNDS
"""Most covered rounds a rank leaves unanswered, and the most it may: the
rounds a sidecar retains to answer retries
(:data:`moe_sidecar.core.policy.RETAINED_ROUNDS`), so that after a sidecar
restart every proposal the client sends again is still answered, with the
answer it had. Enough for a whole model's layers (DeepSeek-V3: 61 MoE
layers and the MTP layer), so a rank never waits on the slowest peer
mid-model; small enough that the answers (about 100 bytes each) fit the
session stream's HTTP/2 flow-control window (64 KiB)."""

_log = logging.getLogger(__name__)


class AlltoAllManager:
    """Sizes, builds, grows and frees one EP group's MoE all-to-all workspace.

    One :meth:`initialize_layer` per MoE layer, on every rank of the EP group
    in the same order. What is built: :attr:`moe_alltoall`,
    :meth:`get_communication`, :attr:`plan`, :attr:`generation`,
    :attr:`workspace_bytes`; :attr:`counters`; :meth:`checkpoint_prepare`,
    :meth:`checkpoint_restore`, :meth:`cleanup`.

    Args:
        cpu_group: the EP group's CPU (gloo) process group; ``ep_size`` and
            ``ep_rank`` are its size and this process's rank in it. Every
            collective of the manager runs on it and on nothing wider.
        group: the EP group's name on the sidecar: model identity + parallel
            layout + pipeline stage, e.g. ``"deepseek-v3:fp4/tp1-ep8/pp0"``.
            None: ``MOE_SIDECAR_GROUP``, else the engine's name
            (``engine.group_name``), else (embedded mode only) from the
            group's global ranks (:mod:`moe_sidecar.client.naming`).
        target: the sidecar's address (``unix:///run/moe-sidecar/sidecar.sock``
            or ``127.0.0.1:50051``). ``None`` reads ``MOE_SIDECAR_TARGET``;
            unset or empty (or ``"embedded"``) means embedded mode.
        backend: ``"flashinfer"`` (GPU: the backend of the installed FlashInfer
            release, its row of :data:`moe_sidecar.flashinfer.RELEASES`; name
            ``"flashinfer-moe-alltoall"`` or ``"flashinfer-moe-ep"`` to choose),
            ``"reference"`` (the CPU copy of its contract over gloo), or an
            object implementing :class:`moe_sidecar.client.backends.AlltoAllBackend`.
            None reads ``MOE_SIDECAR_BACKEND``, else ``"flashinfer"``.
        local_ranks: how many ranks of this EP group run on this node (i.e.
            talk to the same sidecar). Default: env ``MOE_SIDECAR_LOCAL_RANKS``,
            else counted at the first ``initialize()`` by exchanging hostname
            digests on ``cpu_group`` with the group's proof (0 until then:
            :mod:`moe_sidecar.client.first_round`). Ignored in embedded mode,
            where every rank decides alone. When it is below ``ep_size`` every
            round adds one all-gather.
        propose_timeout: seconds one Propose may wait for its round; must
            exceed the sidecar's ``--round-timeout``. Default: env
            ``MOE_SIDECAR_PROPOSE_TIMEOUT``, else 120.
        max_unanswered: most covered rounds left unanswered at once
            (:data:`DEFAULT_MAX_UNANSWERED`); past it a covered round reads
            the oldest answer first.
        engine: the rules of the engine the manager serves (its room's;
            :data:`~moe_sidecar.client.engine_rules.NO_ENGINE`: none).

    Raises:
        InvalidArgument: no group name in sidecar mode (see ``group``), a bad
            group name, ``local_ranks`` outside ``[1, ep_size]``,
            ``max_unanswered`` outside ``[1, RETAINED_ROUNDS]``, or an unknown backend name (naming
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
        engine: EngineRules = NO_ENGINE,
    ) -> None:
        if not 1 <= max_unanswered <= RETAINED_ROUNDS:
            raise InvalidArgument.of(
                "max_unanswered",
                max_unanswered,
                f"must be 1 to {RETAINED_ROUNDS}, the rounds a sidecar retains to answer "
                "the proposals a client sends again after a sidecar restart",
            )
        self.max_unanswered = max_unanswered
        self.engine = engine
        self.cpu_group = cpu_group
        self.ep_size = dist.get_world_size(cpu_group)
        self.ep_rank = dist.get_rank(cpu_group)
        self._transport: Transport = transport_for(target, propose_timeout=propose_timeout)
        self._peer_loss = PeerLossWatch.for_transport(self._transport)
        """Hears of a peer's death while this rank is blocked (MOE_SIDECAR_ON_PEER_LOSS)."""
        self.group = naming.resolve(
            group,
            partial(engine.group_name, cpu_group),
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
        self._owner_digest = ""
        """The group's owner digest (shared with the proof; "": none, or embedded)."""
        self._round = 0
        """Round of the current lifetime (the n-th initialize() since it began)."""
        self._initializes = 0
        self._reuses = 0
        self._covered = 0
        self._last_layer = ""
        masks = self._peer_loss.policy is PeerLossPolicy.MASK
        self._held = HeldWorkspace(self.backend, self.ep_size, self.ep_rank, enable_rank_mask=masks)
        self._views = ViewFollower(
            self._transport,
            self._peer_loss,
            self.group,
            self.ep_size,
            self.ep_rank,
            default_wait_s=getattr(self._transport, "propose_timeout", DEFAULT_PROPOSE_TIMEOUT_S),
        )
        """The membership views this rank follows (``MOE_SIDECAR_ON_PEER_LOSS=mask``)."""
        self._decisions = self._round_decisions()
        self.generation = 0
        """The generation of the plan built last (0: none yet)."""
        self._held_changed()

    def _round_decisions(self) -> RoundDecisions:
        """What this manager's rounds execute, from the decisions received
        and the plan held; late builds through :meth:`_build`."""
        return RoundDecisions(
            self.group,
            self.ep_rank,
            self._transport,
            self._peer_loss,
            self._on_group,
            lambda: self._held.plan,
            ep_size=self.ep_size,
            agrees_across_ranks=self.agrees_across_ranks,
            build=self._build,
            commit=self._commit,
        )

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
        return self._held.plan

    @property
    def counters(self) -> ManagerCounters:
        """A snapshot of what this manager has done."""
        return ManagerCounters(
            rounds=self._initializes,
            builds=self._held.builds,
            rebuilds=self._held.rebuilds,
            reuses=self._reuses,
            releases=self._held.releases,
            rpcs=self._transport.rpc_count,
            covered=self._covered,
            collectives=self._on_group.count,
            first_build_seconds=self._held.first_build_seconds,
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
        return self._views.wrap(self._held.handle)  # type: ignore[no-any-return]

    @property
    def workspace_bytes(self) -> int:
        """Per-rank bytes of the workspace built (0: nothing built)."""
        return self._held.workspace_bytes

    def _held_changed(self) -> None:
        """What is held was built or released. An engine's surface extends it
        to keep the attributes its callers read."""
        if self._held.plan is not None:
            self.generation = self._held.plan.generation

    # --- the round ---------------------------------------------------------

    def _share_group_proof(self) -> None:
        """At a lifetime's first initialize(), before any proposal: the EP
        group's ranks share one secret (rank 0 draws it) that every proposal
        and commit of the lifetime carries, so the sidecar can tell the
        group's ranks from any other process (one collective per lifetime;
        none in embedded mode, where the core is this process's own, nor for a
        group of one rank, which draws it alone). Meanwhile the rank's
        arrival waits at the sidecar, which shows it and ends the wait at its
        round timeout (:mod:`moe_sidecar.client.first_round`). Rank 0's owner
        key rides the same broadcast (:mod:`moe_sidecar.client.owner_key`)."""
        if self._group_proof is not None:
            return
        if self.embedded:
            self._group_proof = ""
            return
        if self.ep_size == 1:
            self._group_proof = new_group_secret()
            self._owner_digest = owner_digest_of(self.group, os.environ)
            return
        # Shared while the sidecar sees this rank arrived (bounded by its round timeout).
        arrival = Arrival(self.group, self.ep_size, self.ep_rank, self.local_ranks, self.lifetime)
        target = getattr(self._transport, "target", "")
        shared = share_proof_in_view(self._on_group, self._transport, arrival, target)
        self._group_proof, self._owner_digest = shared.proof, shared.owner_digest
        if shared.local_ranks != self.local_ranks:
            # Counted in the exchange: whether the rounds agree across nodes follows.
            self.local_ranks = shared.local_ranks
            self._decisions = self._round_decisions()

    def _refuse_mask_across_sidecars(self) -> None:
        """``mask`` only where one sidecar decides the group's views.

        A view is committed by the sidecar that hears the death, for the
        ranks it serves; the group's other sidecars neither hear it nor take
        part, so a group spread over several would step on under a mask of
        each node's own (one group split in two with no partition at all).
        Every rank reaches the same answer from what it already knows
        (``local_ranks`` below ``ep_size``), so no rank waits for a refused one
        in a collective.

        Raises:
            PreconditionFailed: ``MOE_SIDECAR_ON_PEER_LOSS=mask`` in sidecar
                mode for a group whose ranks span more than one sidecar,
                naming the variable, the group and how its ranks are placed.
        """
        if self.embedded or self._peer_loss.policy is not PeerLossPolicy.MASK:
            return
        if self.local_ranks == self.ep_size:
            return
        raise PreconditionFailed(
            f"{ENV_ON_PEER_LOSS}=mask: refused for group {quote_name(self.group)}, whose "
            f"{self.ep_size} ranks span more than one sidecar ({self.local_ranks} on this "
            "rank's node): a membership view is committed by one sidecar for its own ranks, "
            "so the group's nodes would each step on with a mask of their own; use "
            f"{ENV_ON_PEER_LOSS}=exit or raise, or place the group's ranks on one node"
        )

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
            release=self.backend.flashinfer_release.name,
            owner=self._owner_digest,
        )

    def _propose(self, requirement: Requirement) -> Decision:
        return self._transport.propose(self._proposal(requirement))

    def _settle(self, keep: int = 0) -> None:
        """Settles what the rounds passed as covered left, until at most
        ``keep`` answers remain (:meth:`RoundDecisions.settle`).

        Raises:
            CoordinatorError, InternalError, BackendError, AgreementError,
            RankLost: see :meth:`RoundDecisions.settle`.
        """
        self._decisions.settle(self.lifetime, self._last_layer, self._round, keep)

    def _propose_covered(self, need: LayerNeed) -> None:
        """A covered round: sends the proposal and goes on (at most
        ``max_unanswered`` answers outstanding)."""
        self._settle(keep=self.max_unanswered - 1)
        self._round += 1
        self._transport.propose_later(self._proposal(_requirement(need)))
        self._passed_as_covered(need)

    def _passed_as_covered(self, need: LayerNeed) -> None:
        """Counts a round passed as covered (a reuse, unless its answer later
        asks for a build) and keeps its dispatch row."""
        self._covered += 1
        self._reuses += 1
        self._held.layouts.remember(need.layout)

    def initialize_layer(self, need: LayerNeed) -> None:
        """Makes the all-to-all serve this MoE layer; one round of the protocol.

        Every rank of the EP group calls it for the same layers in the same
        order. Afterwards ``moe_alltoall`` (and ``get_communication()``)
        serves this layer and every layer initialized before it in this
        process; it is a new object only when the workspace had to grow.

        Raises:
            PreconditionFailed: another ``top_k``/``num_experts`` than earlier
                layers, or ranks disagreeing on the layer (an
                :class:`~moe_sidecar.client.errors.AgreementError` when the
                cross-rank agreement found it); the message names ranks and layers.
                Also ``MOE_SIDECAR_ON_PEER_LOSS=mask`` for a group whose ranks
                span more than one sidecar (each node would commit a view of
                its own), before anything is proposed (and before anything is
                shared where ``local_ranks`` is stated).
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
        self.initialize_layer_from(lambda: need, need.layer)

    def initialize_layer_from(self, understand: Callable[[], LayerNeed], layer: str) -> None:
        """:meth:`initialize_layer` for a need an engine's room works out from
        its caller's arguments: ``understand()`` is called inside the round, so
        a call it refuses still joins the round's agreement where there is
        one (the other ranks raise too instead of waiting for this one).

        Raises:
            InvalidArgument: what ``understand()`` raises for a bad argument.
            PreconditionFailed, RoundTimedOut, RoundAborted, PermissionDenied,
            CoordinatorUnavailable, BackendError: see :meth:`initialize_layer`.
        """
        if self.local_ranks:
            self._refuse_mask_across_sidecars()  # stated: before anything is shared
        self._share_group_proof()
        self._refuse_mask_across_sidecars()  # counted in the first exchange, if not stated
        self._initializes += 1
        failure: BaseException | None = None
        decision: Decision | None = None
        need: LayerNeed | None = None
        # The round this call is, proposed or not: a failed call joins the
        # agreement of the round its peers are in.
        this_round = self._round + 1
        self._last_layer = layer
        try:
            need = understand()
            covered = self._decisions.passes_as_covered(need.capacities)
            if covered and not self.embedded:
                self._propose_covered(need)
                return
            if not self.embedded:
                # A round that waits reads every earlier answer first (and
                # does what they ask), so it decides on top of what they built.
                # (Embedded: this round's agreement checks the earlier ones.)
                self._settle()
            # A refused call proposes nothing, so it uses up no round: the
            # caller may correct it and go on.
            self._round += 1
            decision = self._propose(_requirement(need))
            if covered and decision.action is Action.REUSE:
                # Embedded: the rank's own core agreed on a covered round; the
                # next agreement checks that every rank passed the same rounds.
                self._decisions.unagreed += 1
                self._passed_as_covered(need)
                return
        except Exception as error:
            if not self.agrees_across_ranks:
                raise
            # Still join the agreement, so the other ranks raise too instead
            # of waiting for this one forever.
            failure = error
        action, plan = self._decisions.decide(layer, decision, failure, this_round)
        assert need is not None  # a failure raised in decide()
        self._execute(need, action, plan)

    def _execute(self, need: LayerNeed, action: Action, plan: Plan) -> None:
        """Does what the round decided: keeps what is built, or builds ``plan``
        and commits it.

        Raises:
            BackendError: the backend could not build.
            RankLost: a peer died in the post-build barrier.
            CoordinatorError: the commit was refused or could not be sent.
        """
        self._held.layouts.remember(need.layout)
        if action is Action.REUSE:
            self._reuses += 1
            _log.debug(
                "group %s round %d (%s): reuse %s", self.group, self._round, need.layer, plan
            )
            return
        build_seconds = self._build(plan, action, need.layer, self._round)
        self._commit(self._round, plan, build_seconds)

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
            InvalidArgument: the engine's combine setting is malformed.
        """
        low_precision = self.engine.low_precision_combine()
        build_seconds = self._held.build(plan, action, low_precision, self._on_group)
        self._held_changed()
        _log.info(
            "group %s round %d (%s): %s at %d bytes/rank, %d tokens, generation %d (%.3fs)",
            self.group,
            round_number,
            layer,
            action.value,
            self._held.workspace_bytes,
            plan.capacities.max_tokens,
            plan.generation,
            build_seconds,
        )
        return build_seconds

    # --- what the engines' surfaces read -----------------------------------

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
            InvalidArgument: the engine's combine setting is malformed.
        """
        self._settle()
        communication = self._held.communication(self.engine.low_precision_combine())
        if communication is None:
            raise BackendError("get_communication() before initialize(): nothing is built")
        return self._views.wrap(communication)

    # --- membership views (MOE_SIDECAR_ON_PEER_LOSS=mask) ----------------------

    def peer_fault(self) -> bool:
        """A peer of this lifetime died and no view was adopted since (under
        ``mask``; always False otherwise). Cheap: no RPC, no device work."""
        return self._views.peer_fault()

    def active_mask(self) -> int:
        """The mask every step passes: bit i set = rank i a member of the
        adopted view (every rank's while none is adopted)."""
        return self._views.active_mask()

    def adopt_view(self, timeout_s: float | None = None) -> AdoptedView:
        """At a quiesced point (this rank's last combine done): acknowledges the
        group's latest proposed view with this rank's all-to-all round count,
        waits (at most ``timeout_s`` s; default the propose timeout) until it
        commits, and from then on every dispatch and combine of what
        :attr:`moe_alltoall` and :meth:`get_communication` return passes its
        mask (:mod:`moe_sidecar.client.membership_view`).

        Raises:
            PreconditionFailed: the policy is not ``mask``, embedded mode,
                nothing built, this rank is no member of the view, or a
                replacement joined it (a rebuild this manager does not make).
            ViewFailed: the view failed: every rank of the group restarts.
            RoundTimedOut: the view was not decided in time.
            CoordinatorError: a covered round was refused, or the sidecar
                could not be asked.
        """
        self._settle()  # the session carries nothing unanswered before the acknowledgement
        held = self._held.plan.generation if self._held.plan is not None else None
        return self._views.adopt(timeout_s, held_generation=held)

    def rejoin(self, cpu_group: dist.ProcessGroup, timeout_s: float | None = None) -> AdoptedView:
        """A replacement joined the re-formed ``cpu_group``: see (and for Raises:)
        :func:`moe_sidecar.client.rejoin.rejoin_survivor`."""
        return rejoin_survivor(self, cpu_group, timeout_s)

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
        self._decisions.unagreed = 0  # embedded: cleanup agrees on nothing
        try:
            self._settle()
        except Exception as error:
            unsettled = error
        self._held.release()
        self._held_changed()
        self._transport.close()
        self.lifetime = new_lifetime_secret()
        self._group_proof = None
        self._round = 0
        self._views.forget()
        if unsettled is not None:
            raise unsettled


def _requirement(need: LayerNeed) -> Requirement:
    return Requirement(capacities=need.capacities, layer=need.layer)
