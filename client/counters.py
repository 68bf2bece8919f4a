"""What one :class:`~moe_sidecar.client.manager.AlltoAllManager` has done so far."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ManagerCounters"]


@dataclass(frozen=True)
class ManagerCounters:
    """What one manager has done so far; tests assert on differences."""

    rounds: int
    """``initialize()`` calls (rounds proposed)."""
    builds: int
    """Rounds that built the first all-to-all of the lifetime (BUILD)."""
    rebuilds: int
    """Rounds that built a larger one and released the old (REBUILD)."""
    reuses: int
    """Rounds that kept what was built (REUSE), covered rounds included when
    they return (one whose answer later asked for a build also counts there)."""
    releases: int
    """Workspaces handed back to the backend (rebuilds and cleanup)."""
    rpcs: int
    """Calls sent to the sidecar, retries included (0 in embedded mode)."""
    covered: int
    """Rounds passed as covered: proposed without waiting for the answer."""
    collectives: int
    """Collectives the manager issued on ``cpu_group`` (the first round's
    proof and hostname exchange, agreement, barrier); the backend's own build
    collectives are not counted here."""
    first_build_seconds: float | None = None
    """Seconds the first build of this process took (None: nothing built yet).
    With FlashInfer it includes loading (or JIT-compiling) its module: a cold
    start shows here as minutes, a prewarmed one as seconds."""
    jit_compiled: bool | None = None
    """Whether the backend had to JIT-compile its module (None: not known,
    e.g. nothing built yet or a backend without a JIT)."""
