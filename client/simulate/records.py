"""One simulation's configuration, what its ranks report, and its result (pure values).

The ranks send :class:`RoundRecord`, :class:`RankReport` and
:class:`SimulatedRankFailure` to the parent through a queue; the parent
gathers them, with what the sidecars hold (:class:`NodeView`), into a
:class:`SimulationResult`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from moe_sidecar.client.simulate.death import DeathReport
from moe_sidecar.client.simulate.presets import ModelPreset
from moe_sidecar.core.defaults import EMBEDDED, ENV_TARGET, PEER_LOSS_POLICIES
from moe_sidecar.core.group import Growth
from moe_sidecar.core.limits import MAX_EP_SIZE

__all__ = [
    "MAX_NODES",
    "NODE_NAMES",
    "NodeView",
    "RankReport",
    "RankStarted",
    "RoundRecord",
    "SimulatedRankFailure",
    "SimulationConfig",
    "SimulationResult",
    "resolve_target",
]

MAX_NODES = 4
"""Sidecars ``--nodes`` may start."""
NODE_NAMES = tuple(f"node-{letter}" for letter in "abcd")


@dataclass(frozen=True)
class SimulationConfig:
    """One run of the demo; validated on construction.

    Raises:
        ValueError: a value out of range (the message names it).
    """

    model: ModelPreset
    ranks: int
    target: str | None
    """The sidecar's address, or None for embedded mode."""
    group: str
    max_tokens: int
    propose_timeout: float | None
    """Seconds one Propose may wait (None: the manager's default)."""
    timeout: float
    """Seconds the whole run may take before the ranks are stopped."""
    check: bool
    """Run the dispatch+combine checks."""
    nodes: int = 1
    """Sidecars to start on ``store`` and split the ranks between (1: none started)."""
    store: str = ""
    """The etcd URL the started sidecars share (``nodes`` > 1)."""
    start_sidecar: bool = False
    """Start one throwaway sidecar for the run (``--start-sidecar``)."""
    kill_rank: int | None = None
    """The rank the parent kills with SIGKILL in round ``kill_round`` (None: no kill)."""
    kill_round: int = 0
    """The round (1-based) in whose step ``kill_rank`` is killed."""
    on_peer_loss: str | None = None
    """``MOE_SIDECAR_ON_PEER_LOSS`` in the ranks (None: as the environment says)."""
    loss_wait: float = 10.0
    """Seconds the survivors of a death are given to act on it."""

    def __post_init__(self) -> None:
        """Checks every value against its range.

        Raises:
            ValueError: a value out of range, named with the flag that set it.
        """
        fewest_experts = min(layer.num_experts for layer in self.model.layers)
        if not 1 <= self.ranks <= min(MAX_EP_SIZE, fewest_experts):
            raise ValueError(
                f"--ranks {self.ranks}: must be in [1, {min(MAX_EP_SIZE, fewest_experts)}] "
                f"({self.model.name} has {fewest_experts} experts; FlashInfer allows "
                f"{MAX_EP_SIZE} ranks)"
            )
        if not 1 <= self.max_tokens <= 4096:
            raise ValueError(f"--max-tokens {self.max_tokens}: must be in [1, 4096]")
        if not 0 < self.timeout <= 86400:
            raise ValueError(f"--timeout {self.timeout}: must be in (0, 86400] seconds")
        if self.propose_timeout is not None and not 0 < self.propose_timeout <= 86400:
            raise ValueError(
                f"--propose-timeout {self.propose_timeout}: must be in (0, 86400] seconds"
            )
        if not 1 <= self.nodes <= min(MAX_NODES, self.ranks):
            raise ValueError(
                f"--nodes {self.nodes}: must be in [1, {min(MAX_NODES, self.ranks)}] "
                f"(at most {MAX_NODES}, and at least one rank per node)"
            )
        if self.start_sidecar and (self.target is not None or self.nodes > 1):
            raise ValueError(
                "--start-sidecar starts the run's own sidecar: leave out --target "
                "(and MOE_SIDECAR_TARGET) and --nodes"
            )
        if self.nodes > 1 and self.target is not None:
            raise ValueError("--nodes starts its own sidecars: leave out --target")
        if self.nodes > 1 and not self.store.startswith(("etcd://", "etcds://")):
            raise ValueError(
                f"--nodes {self.nodes} needs --store etcd://HOST:PORT/PREFIX, the etcd the "
                "started sidecars share (e.g. run `etcd --data-dir /tmp/etcd` and pass "
                "--store etcd://127.0.0.1:2379/moe-simulate)"
            )
        self._check_death()

    def _check_death(self) -> None:
        """Checks the flags of a requested death.

        Raises:
            ValueError: a value out of range, named with the flag that set it.
        """
        if self.on_peer_loss is not None and self.on_peer_loss not in PEER_LOSS_POLICIES:
            raise ValueError(
                f"--on-peer-loss {self.on_peer_loss!r}: must be one of "
                + ", ".join(PEER_LOSS_POLICIES)
            )
        if not 0 < self.loss_wait <= 3600:
            raise ValueError(f"--loss-wait {self.loss_wait}: must be in (0, 3600] seconds")
        if self.kill_rank is None:
            if self.kill_round:
                raise ValueError(f"--at-round {self.kill_round}: needs --kill-rank")
            return
        if self.ranks < 2:
            raise ValueError(
                f"--kill-rank {self.kill_rank}: needs --ranks 2 or more (a survivor to watch)"
            )
        if not 0 <= self.kill_rank < self.ranks:
            raise ValueError(f"--kill-rank {self.kill_rank}: must be in [0, {self.ranks - 1}]")
        layers = len(self.model.layers)
        if not 1 <= self.kill_round <= layers:
            raise ValueError(
                f"--at-round {self.kill_round}: must be in [1, {layers}] "
                f"({self.model.name} has {layers} MoE layers, one round each)"
            )

    @property
    def embedded(self) -> bool:
        """No sidecar: the decision core runs inside the ranks."""
        return self.target is None and self.nodes == 1 and not self.start_sidecar

    @property
    def starts_sidecars(self) -> int:
        """How many sidecars the run starts itself (0: none)."""
        return self.nodes if self.nodes > 1 else int(self.start_sidecar)

    def node_of(self, ep_rank: int) -> int:
        """The node (0-based) whose sidecar rank ``ep_rank`` talks to: contiguous blocks."""
        return ep_rank * self.nodes // self.ranks

    def node_name(self, ep_rank: int) -> str:
        """The name of ``ep_rank``'s node (``node-a``, ...); "" without ``--nodes``."""
        return NODE_NAMES[self.node_of(ep_rank)] if self.nodes > 1 else ""

    def local_ranks(self, ep_rank: int) -> int:
        """How many ranks share ``ep_rank``'s node."""
        node = self.node_of(ep_rank)
        return sum(1 for r in range(self.ranks) if self.node_of(r) == node)


@dataclass(frozen=True)
class RoundRecord:
    """What one round did, as rank 0 saw it (every rank takes the same branch)."""

    round: int
    layer: str
    quant: str
    action: str
    """``build``, ``rebuild`` or ``reuse``."""
    workspace_bytes: int
    max_num_tokens: int
    generation: int
    seconds: float


@dataclass(frozen=True)
class RankReport:
    """Where one rank ended."""

    ep_rank: int
    workspace_bytes: int
    max_num_tokens: int
    generation: int
    rounds: int
    builds: int
    rebuilds: int
    reuses: int
    rpcs: int
    collectives: int
    checked_layers: tuple[str, ...]
    """Layers whose dispatch+combine was checked (exact on every one)."""


@dataclass(frozen=True)
class SimulatedRankFailure:
    """A rank's error, sent to the parent before the rank exits."""

    ep_rank: int
    error_type: str
    message: str
    traceback: str
    at: float = 0.0
    """When it was raised (CLOCK_MONOTONIC, which the parent shares)."""


@dataclass(frozen=True)
class NodeView:
    """What one node's sidecar holds of the group at the end of a ``--nodes`` run."""

    node: str
    target: str
    epoch: int
    generation: int
    workspace_bytes: int
    origin_node: str
    """The node whose sidecar made the plan (from the growth history)."""
    origin_time: float


@dataclass
class SimulationResult:
    """Everything the summary shows; ``failures`` empty means success."""

    model: str
    ranks: int
    target: str | None
    group: str
    rounds: list[RoundRecord] = field(default_factory=list)
    reports: list[RankReport] = field(default_factory=list)
    failures: list[SimulatedRankFailure] = field(default_factory=list)
    error: str = ""
    """A failure outside the ranks (sidecar unreachable, the run timed out)."""
    sidecar_lifetimes: int = 0
    sidecar_history: list[Growth] = field(default_factory=list)
    nodes: list[NodeView] = field(default_factory=list)
    """Each started node's view of the group (``--nodes``)."""
    startup_seconds: float | None = None
    """Seconds until every rank was up (None: not every rank came up)."""
    wall_seconds: float = 0.0
    total_rounds: int = 0
    """The model's MoE layers: the rounds of a whole run."""
    kill_rank: int | None = None
    """The rank asked to be killed (``--kill-rank``), None: none."""
    kill_round: int = 0
    death: DeathReport | None = None
    """A rank that died during the run (asked for or not) and what its survivors did."""
    stderr: dict[int, str] = field(default_factory=dict)
    """What each rank wrote on its stderr, the lines of the death report left out."""

    @property
    def ok(self) -> bool:
        """Every rank reported and nothing failed; with a death asked for, every
        survivor acted as its policy says."""
        if self.failures or self.error:
            return False
        if self.death is not None:
            return self.death.requested and self.death.every_survivor_acted
        return len(self.reports) == self.ranks

    @property
    def nodes_agree(self) -> bool:
        """Every started node holds the same plan (vacuously true without ``--nodes``)."""
        return len({(v.epoch, v.generation, v.workspace_bytes) for v in self.nodes}) <= 1

    @property
    def builds(self) -> int:
        """Rounds whose action was ``build``."""
        return sum(1 for r in self.rounds if r.action == "build")

    @property
    def rebuilds(self) -> int:
        """Rounds whose action was ``rebuild``."""
        return sum(1 for r in self.rounds if r.action == "rebuild")

    def as_json(self) -> dict[str, Any]:
        """Plain JSON values, with the derived counts."""
        document = asdict(self)
        document.update(
            ok=self.ok, builds=self.builds, rebuilds=self.rebuilds, nodes_agree=self.nodes_agree
        )
        document["stderr"] = {str(rank): text for rank, text in self.stderr.items()}
        return document


@dataclass(frozen=True)
class RankStarted:
    """A rank joined the gloo group (the parent times the start-up by it)."""

    ep_rank: int


def resolve_target(given: str | None, environ: Mapping[str, str]) -> str | None:
    """The sidecar address to use, or None for embedded mode.

    ``given`` (``--target``) wins; else ``$MOE_SIDECAR_TARGET``; unset, empty
    or ``embedded`` means embedded mode.
    """
    target = (given if given is not None else environ.get(ENV_TARGET, "")).strip()
    return None if not target or target == EMBEDDED else target
