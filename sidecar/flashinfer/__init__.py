"""Every FlashInfer release the project drives: one module each, one table. Pure, torch-free.

Each release module (:mod:`.v0_7_2_post1`, :mod:`.v0_7_4`) holds that
release's exact workspace arithmetic, dispatch-format byte table, limits,
JIT module and refusals, and builds one :class:`~.release.Release`;
:data:`RELEASES` lists them, oldest first. The client's backends, ``moe-sidecar
size``, ``prewarm``, the JIT-cache report and the sidecar's workspace ceiling
read this table; no other module of the project spells a release.

A proposal carries its rank's release by :attr:`Release.name`; an empty
name (a client older than the field, a row stored before it) means
:data:`DEFAULT_RELEASE`, the release those clients drove.
:func:`workspace_size` is the size function the decision core takes.

Imports nothing but the decision core and the standard library.
"""

from __future__ import annotations

from typing import Final

from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.plan import Capacities
from moe_sidecar.flashinfer import v0_7_2_post1, v0_7_4
from moe_sidecar.flashinfer.release import JitModuleFacts, LayoutError, Release, parse_version

__all__ = [
    "DEFAULT_RELEASE",
    "RELEASES",
    "JitModuleFacts",
    "LayoutError",
    "Release",
    "check_release_name",
    "release_for_version",
    "release_named",
    "release_serving",
    "workspace_size",
]

RELEASES: Final = (v0_7_2_post1.RELEASE, v0_7_4.RELEASE)
"""The releases the project drives, oldest first."""

DEFAULT_RELEASE: Final = v0_7_2_post1.RELEASE
"""What an empty release name means: the release every client before the
field drove (vLLM 0.33's pin)."""

_BY_NAME: Final = {r.name: r for r in RELEASES}
_BY_VERSION: Final = {v: r for r in RELEASES for v in r.versions}


def release_named(name: str) -> Release:
    """The release a proposal names (empty: :data:`DEFAULT_RELEASE`).

    Raises:
        LookupError: no release of that name, naming the known ones.
    """
    if not name:
        return DEFAULT_RELEASE
    try:
        return _BY_NAME[name]
    except KeyError:
        raise LookupError(
            f"FlashInfer release {name!r}: must be one of {', '.join(_BY_NAME)}"
        ) from None


def check_release_name(field: str, name: str) -> str:
    """``name`` resolved to a release's name (empty: :data:`DEFAULT_RELEASE`'s).

    Raises:
        InvalidArgument: not a release's name, naming ``field`` and the value.
    """
    if not isinstance(name, str):
        raise InvalidArgument.of(field, name, "must be a string")
    try:
        return release_named(name).name
    except LookupError:
        raise InvalidArgument.of(
            field, name, f"must be a FlashInfer release: one of {', '.join(_BY_NAME)}"
        ) from None


def release_for_version(version: str) -> Release | None:
    """The release serving the installed flashinfer-python ``version`` exactly
    (its all-to-all files are the row's), or None."""
    return _BY_VERSION.get(version)


def release_serving(version: str) -> Release:
    """The release whose API an installed ``version`` has: its exact row, else
    the newest release numbered no later than it (the oldest for anything
    older: FlashInfer changed its all-to-all API only at the rows' releases).

    Raises:
        ValueError: a version string that does not start with a release number.
    """
    exact = release_for_version(version)
    if exact is not None:
        return exact
    number = parse_version(version)
    earlier = [r for r in RELEASES if r.release_number <= number]
    return earlier[-1] if earlier else RELEASES[0]


def workspace_size(release: str, capacities: Capacities, ep_size: int) -> int:
    """Per-rank bytes ``release`` (by name; empty: the default) builds for
    ``capacities`` at ``ep_size``: the size function the decision core takes.

    Raises:
        LookupError: an unknown release name.
        LayoutError: the release's layout refuses the capacities.
    """
    return release_named(release).workspace_bytes(capacities, ep_size)
