"""A backend whose workspaces are SGLang's namespace padding larger.

SGLang adds ``128 * namespace`` bytes to each namespace's workspace so that
FlashInfer's workspace cache (keyed by size) never hands two concurrently
live namespaces the same memory. The manager sizes a plan with its
backend's ``workspace_bytes``; this wrapper adds the padding there, so the
build, ``workspace_size`` and the release all see the padded size, and
delegates everything else to the backend it wraps.
"""

from __future__ import annotations

from typing import Any

from moe_sidecar.client.backends import AlltoAll, AlltoAllBackend, BuildSpec
from moe_sidecar.client.backends.base import CommunicationSpec
from moe_sidecar.core.plan import Capacities

__all__ = ["PaddedBackend"]


class PaddedBackend:
    """``inner`` with ``padding`` bytes added to every workspace it builds."""

    def __init__(self, inner: AlltoAllBackend, padding: int) -> None:
        if padding < 0:
            raise ValueError(f"padding={padding}: must be non-negative")
        self.inner = inner
        self.padding = padding

    @property
    def name(self) -> str:
        """The wrapped backend's name."""
        return self.inner.name

    def workspace_bytes(self, capacities: Capacities, ep_size: int) -> int:
        """The wrapped backend's size plus the namespace padding."""
        return self.inner.workspace_bytes(capacities, ep_size) + self.padding

    def build(self, spec: BuildSpec) -> AlltoAll:
        """See :meth:`AlltoAllBackend.build` (``spec`` is already padded).

        Raises:
            BackendError: the wrapped backend cannot build.
        """
        return self.inner.build(spec)

    def communication(self, handle: AlltoAll, spec: CommunicationSpec) -> Any:
        """See :meth:`AlltoAllBackend.communication`.

        Raises:
            BackendError: the wrapped backend cannot describe ``handle``.
        """
        return self.inner.communication(handle, spec)

    def release(self, handle: AlltoAll) -> None:
        """See :meth:`AlltoAllBackend.release`."""
        self.inner.release(handle)

    def __getattr__(self, name: str) -> Any:
        # What the manager reads of some backends (jit_compiled, module_load).
        return getattr(self.inner, name)
