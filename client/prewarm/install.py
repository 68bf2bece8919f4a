"""The installed flashinfer-python, found without importing it, and the module it builds.

:data:`JIT_MODULES` lists, per FlashInfer release the client drives
(:data:`moe_sidecar.flashinfer.RELEASES`), the all-to-all JIT module ``prewarm``
builds for it (with the cache rule); an installed release not listed is
refused before anything is built.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moe_sidecar import flashinfer
from moe_sidecar.client.prewarm.cache import JitModule, jit_module_of
from moe_sidecar.client.prewarm.errors import FlashInferMissing, FlashInferVersionMismatch

__all__ = [
    "DEFAULT_JIT_MODULE",
    "FLASHINFER_DISTRIBUTION",
    "JIT_MODULES",
    "FlashInferInstall",
    "find_flashinfer",
]

FLASHINFER_DISTRIBUTION = "flashinfer-python"

JIT_MODULES: Mapping[str, JitModule] = {
    release.name: jit_module_of(release) for release in flashinfer.RELEASES
}
"""The all-to-all module of each flashinfer-python release the client drives
(a row of :data:`moe_sidecar.flashinfer.RELEASES`): what ``prewarm`` builds."""
DEFAULT_JIT_MODULE: JitModule = JIT_MODULES[flashinfer.DEFAULT_RELEASE.name]

_RELEASES = " or ".join(JIT_MODULES)
_INSTALL_HINT = "from a moe-sidecar checkout: pip install " + " or ".join(
    f"'.[{release.install_extra}]'" for release in flashinfer.RELEASES
)


@dataclass(frozen=True)
class FlashInferInstall:
    """The installed flashinfer-python, found without importing it."""

    version: str
    package_dir: Path
    """The ``flashinfer`` package directory, resolved as FlashInfer resolves it."""
    jit_module: JitModule = DEFAULT_JIT_MODULE
    """The all-to-all module this release builds, and where it keeps it."""

    def aot_library(self, module: str | None = None) -> Path:
        """``flashinfer/data/aot/<module>/<module>.so`` (``jit_env.FLASHINFER_AOT_DIR``);
        ``module`` defaults to this release's all-to-all module."""
        name = module if module is not None else self.jit_module.name
        return self.package_dir / "data" / "aot" / name / f"{name}.so"


def find_flashinfer() -> FlashInferInstall:
    """The installed flashinfer-python, checked to be a release the client drives.

    Raises:
        FlashInferMissing: not importable, no distribution metadata, or its
            all-to-all sources (``data/csrc``) are missing.
        FlashInferVersionMismatch: another release.
    """
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise FlashInferMissing(
            f"flashinfer-python is not installed: prewarm needs flashinfer-python "
            f"{_RELEASES}, the client's flashinfer extras ({_INSTALL_HINT})"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    try:
        version = importlib.metadata.version(FLASHINFER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise FlashInferMissing(
            f"flashinfer is importable from {package_dir} but no {FLASHINFER_DISTRIBUTION} "
            f"distribution is installed; install flashinfer-python {_RELEASES} "
            f"({_INSTALL_HINT})"
        ) from error
    release = flashinfer.release_for_version(version)
    jit_module = JIT_MODULES[release.name] if release is not None else None
    if jit_module is None:
        raise FlashInferVersionMismatch(
            f"flashinfer-python {version} is installed; the client's all-to-all backends "
            f"drive {_RELEASES}: "
            + " or ".join(f"pip install flashinfer-python=={r}" for r in JIT_MODULES)
        )
    for relative in jit_module.sources:
        source = package_dir / relative
        if not source.is_file():
            raise FlashInferMissing(
                f"{package_dir} lacks {relative}: this flashinfer-python install has no "
                "source for the all-to-all module to compile"
            )
    return FlashInferInstall(version=version, package_dir=package_dir, jit_module=jit_module)
