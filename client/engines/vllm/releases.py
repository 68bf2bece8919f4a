"""Which FlashInfer releases a vLLM release runs on through moe-sidecar, checked at plugin load.

Two rules, both about what is installed beside vLLM, checked before the
plugin changes anything (:func:`check_releases`):

* **a FlashInfer release the table has**: the installed flashinfer-python
  must be a version of a row of :data:`moe_sidecar.flashinfer.RELEASES`
  exactly. A release without a row (vLLM 0.34 pins one the package registry
  lacks, which only vLLM's images carry) is refused rather than served by the row before it: its
  all-to-all layout is unchecked, and the row before it may drive another API;
* **the generation vLLM's code calls**: from vLLM 0.34 on, vLLM's own
  prepare/finalize passes ``dispatch(..., runtime_max_tokens_per_rank=)`` and
  its manager builds ``NVLinkOneSidedConfig(..., cft=False, lamport=False)``:
  the API of the ``moe_ep`` release (:data:`MOE_EP_BACKEND`), not of the
  ``MoeAlltoAll`` one. vLLM 0.34 with the ``MoeAlltoAll`` release cannot
  run; it is refused naming both versions and the extra that installs the
  right one.

The rules read versions only (``importlib.metadata``): no vLLM or FlashInfer
module is imported.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Final

from moe_sidecar.flashinfer import RELEASES, Release, release_for_version
from moe_sidecar.flashinfer.release import parse_version

__all__ = [
    "MOE_EP_BACKEND",
    "MOE_EP_VLLM",
    "InstalledReleases",
    "UnsupportedReleases",
    "check_releases",
    "installed_releases",
]

MOE_EP_VLLM: Final = (0, 34, 0)
"""The first vLLM release whose code calls the ``moe_ep`` release's API
(``runtime_max_tokens_per_rank=``, ``cft``/``lamport``)."""
MOE_EP_BACKEND: Final = "flashinfer-moe-ep"
"""The backend of the releases with that API (their rows' ``backend``)."""


class UnsupportedReleases(RuntimeError):
    """The installed vLLM and FlashInfer cannot be served together (the
    message names both versions and what to install)."""


@dataclass(frozen=True)
class InstalledReleases:
    """The vLLM and FlashInfer found installed, and the table's row for the latter."""

    vllm: str
    flashinfer: str | None
    """flashinfer-python's version (None: not installed)."""
    release: Release | None
    """The row of :data:`~moe_sidecar.flashinfer.RELEASES` serving ``flashinfer``
    exactly (None: FlashInfer not installed)."""

    def describe(self) -> str:
        """What was found, for the plugin's log line."""
        if self.flashinfer is None:
            return "FlashInfer not installed"
        assert self.release is not None
        return f"FlashInfer {self.flashinfer} (the {self.release.name} row, {self.release.backend})"


def _newest_moe_ep() -> Release:
    return [r for r in RELEASES if r.backend == MOE_EP_BACKEND][-1]


def check_releases(vllm: str, flashinfer: str | None) -> InstalledReleases:
    """The releases found, once both rules hold.

    Raises:
        UnsupportedReleases: a FlashInfer release without a row of the table,
            or a vLLM from :data:`MOE_EP_VLLM` on with a release of another API.
        ValueError: a version string that does not start with a release number.
    """
    if flashinfer is None:
        return InstalledReleases(vllm, None, None)
    wanted = _newest_moe_ep()
    modern = parse_version(vllm) >= MOE_EP_VLLM
    release = release_for_version(flashinfer)
    if release is None:
        served = ", ".join(v for r in RELEASES for v in r.versions)
        fix = (
            f"install flashinfer-python=={wanted.name} (from a moe-sidecar checkout: pip install "
            f"'.[{wanted.install_extra}]')"
            if modern
            else f"install one of them (extras {', '.join(f'[{r.install_extra}]' for r in RELEASES)})"
        )
        raise UnsupportedReleases(
            f"vLLM {vllm} with FlashInfer {flashinfer}: moe-sidecar serves FlashInfer {served} "
            f"exactly, and {flashinfer} has no row of its release table (its all-to-all layout "
            f"is unchecked; another release's row is not assumed to fit); {fix}"
        )
    if modern and release.backend != MOE_EP_BACKEND:
        raise UnsupportedReleases(
            f"vLLM {vllm} with FlashInfer {flashinfer}: vLLM's prepare/finalize passes "
            "dispatch(..., runtime_max_tokens_per_rank=) and its config cft/lamport, the API of "
            f"FlashInfer {wanted.name}'s moe_ep, which {flashinfer} lacks; install "
            f"flashinfer-python=={wanted.name} (from a moe-sidecar checkout: pip install "
            f"'.[{wanted.install_extra}]')"
        )
    return InstalledReleases(vllm, flashinfer, release)


def installed_releases() -> InstalledReleases:
    """:func:`check_releases` of what is installed.

    Raises:
        UnsupportedReleases, ValueError: see :func:`check_releases`.
    """
    try:
        flashinfer: str | None = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        flashinfer = None
    return check_releases(importlib.metadata.version("vllm"), flashinfer)
