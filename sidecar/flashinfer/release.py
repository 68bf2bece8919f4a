"""What the project knows of one FlashInfer release: one frozen row of facts. Pure.

A :class:`Release` is what every part that depends on a release reads (the
client's backends, ``size``, ``prewarm``, the JIT-cache report, the
sidecar's ceiling): the versions it serves, its exact per-rank workspace
size, its dispatch-format byte table, its limits (EP size, ``top_k``), its
all-to-all JIT module and what its all-to-all object refuses. Each release
module of this package builds one; :mod:`moe_sidecar.flashinfer` lists them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from moe_sidecar.core.plan import Capacities

__all__ = ["JitModuleFacts", "LayoutError", "Release", "parse_version"]


class LayoutError(ValueError):
    """A release's layout (or its all-to-all object) refuses a configuration.

    The message names the argument and the value, as FlashInfer's check does.
    """


def parse_version(version: str) -> tuple[int, int, int]:
    """The release number a version string starts with (``"0.7.2.post1"`` -> ``(0, 7, 2)``).

    Raises:
        ValueError: a string that does not start with ``MAJOR.MINOR.PATCH``.
    """
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"flashinfer-python version {version!r}: not a release number")
    major, minor, patch = (int(part) for part in match.groups())
    return (major, minor, patch)


@dataclass(frozen=True)
class JitModuleFacts:
    """A release's all-to-all JIT module, as FlashInfer names and builds it."""

    name: str
    """Its directory and library name in FlashInfer's JIT cache."""
    sources: tuple[str, ...]
    """Its own source files, relative to the flashinfer package (the rest are
    FlashInfer's shared headers): an install without one cannot compile it."""
    spec_factory: str
    """``package.module:function`` returning FlashInfer's JIT spec of the module."""
    role: str
    """What the module is, for reports: whose all-to-all it is."""


@dataclass(frozen=True)
class Release:
    """One FlashInfer release the project drives (a row of :data:`~moe_sidecar.flashinfer.RELEASES`)."""

    name: str
    """The flashinfer-python version the row is named by (what a proposal carries)."""
    versions: tuple[str, ...]
    """Every flashinfer-python version this row serves exactly (its all-to-all
    files are byte-identical to those of :attr:`name`)."""
    backend: str
    """The client's backend that drives it (``moe_sidecar.client.backends``)."""
    api: str
    """The FlashInfer class that backend builds, for messages."""
    max_ranks: int
    """Its ``kMaxRanks``: the largest EP group its layout takes."""
    rank_mask_words: int
    """The 64-bit words of its ``active_rank_mask`` (a CPU ``uint64`` tensor,
    lowest ranks first): enough for :attr:`max_ranks` ranks."""
    max_top_k: int
    """Its ``kMaxTopK``: the largest ``top_k`` its layout takes."""
    supported_top_k: tuple[int, ...]
    """The ``top_k`` values its all-to-all object accepts."""
    dispatch_format_bytes: Mapping[str, Callable[[int], int]]
    """Bytes one token's activations and their scales take on the wire, by
    ``QuantFormat`` name, as functions of the hidden size."""
    jit_module: JitModuleFacts
    workspace_size: Callable[[Capacities, int], int]
    """Per-rank bytes of the workspace built for ``(capacities, ep_size)``;
    raises :class:`LayoutError` for what the layout refuses."""
    object_refusals: Callable[[int, int, int, int], tuple[str, ...]]
    """Why its all-to-all object would refuse ``(ep_size, top_k, num_experts,
    eplb_experts)`` beyond the layout (empty: it would not)."""
    install_extra: str
    """The moe-sidecar extra that installs it (``pip install '.[EXTRA]'``)."""

    @property
    def release_number(self) -> tuple[int, int, int]:
        """The earliest release number it serves."""
        return min(parse_version(v) for v in self.versions)

    def workspace_bytes(self, capacities: Capacities, ep_size: int) -> int:
        """Per-rank workspace bytes this release builds for ``capacities`` at ``ep_size``.

        Raises:
            LayoutError: the release's layout refuses them.
        """
        return self.workspace_size(capacities, ep_size)

    def format_bytes(self, dispatch_format: str, hidden_size: int) -> int:
        """Bytes of one token's ``dispatch_format`` row and scales at ``hidden_size``.

        Raises:
            LayoutError: a format this release does not dispatch, naming it.
        """
        try:
            rule = self.dispatch_format_bytes[dispatch_format]
        except KeyError:
            raise LayoutError(
                f"dispatch_format={dispatch_format!r}: must be one of "
                f"{', '.join(self.dispatch_format_bytes)}"
            ) from None
        return rule(hidden_size)
