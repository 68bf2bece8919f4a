"""How many Session streams the servicer serves at once: :class:`SessionPlaces`.

Each Session stream holds a handler, its rank's binding and what grpc buffers
for it; a flood of them (20,000 streams) once met grpc's own limits first,
answered ``INTERNAL: Internal error from Core``. Beyond ``--max-sessions``
open streams a new one is refused at once with RESOURCE_EXHAUSTED naming the
flag, counted as ``moe_sidecar_limit_refusals_total{resource="sessions"}``;
``moe_sidecar_sessions`` shows how many are open.
"""

from __future__ import annotations

from moe_sidecar.core.errors import ResourceExhausted
from moe_sidecar.metrics import SidecarMetrics

__all__ = ["SessionPlaces"]


class SessionPlaces:
    """The ``max_sessions`` places of open Session streams.

    Not thread-safe: use it from the sidecar's event loop.
    """

    def __init__(self, metrics: SidecarMetrics, max_sessions: int) -> None:
        self._metrics = metrics
        self.max_sessions = max_sessions
        self._open = 0

    def open_session(self) -> None:
        """Takes a place for a Session stream (given back by :meth:`close_session`).

        Raises:
            ResourceExhausted: every place is taken (naming ``--max-sessions``).
        """
        if self._open >= self.max_sessions:
            self._metrics.refused("sessions")
            raise ResourceExhausted(
                f"{self._open} Session streams are open; --max-sessions is "
                f"{self.max_sessions}: retry once one ends, or raise --max-sessions"
            )
        self._open += 1
        self._metrics.sessions.set(self._open)

    def close_session(self) -> None:
        """Gives back a place :meth:`open_session` took."""
        self._open -= 1
        self._metrics.sessions.set(self._open)
