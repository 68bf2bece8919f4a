"""The installed flashinfer-python, found without importing it, and the module it builds.

:data:`JIT_MODULES` lists, per FlashInfer release the client drives, the
all-to-all JIT module ``prewarm`` builds for it (with that release's cache
rule); an installed release not listed is refused before anything is built.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moe_sidecar.client.backends.flashinfer import SUPPORTED_FLASHINFER
from moe_sidecar.client.prewarm.cache import JitModule
from moe_sidecar.client.prewarm.errors import FlashInferMissing, FlashInferVersionMismatch
from moe_sidecar.client.prewarm.mnnvl_moe_alltoall import MNNVL_MOE_ALLTOALL

__all__ = ["FLASHINFER_DISTRIBUTION", "JIT_MODULES", "FlashInferInstall", "find_flashinfer"]

FLASHINFER_DISTRIBUTION = "flashinfer-python"

JIT_MODULES: Mapping[str, JitModule] = {m.flashinfer_version: m for m in (MNNVL_MOE_ALLTOALL,)}
"""The module ``prewarm`` builds, by the flashinfer-python release installed."""

_INSTALL_HINT = "from a moe-sidecar checkout: pip install '.[flashinfer]'"


@dataclass(frozen=True)
class FlashInferInstall:
    """The installed flashinfer-python, found without importing it."""

    version: str
    package_dir: Path
    """The ``flashinfer`` package directory, resolved as FlashInfer resolves it."""
    jit_module: JitModule = MNNVL_MOE_ALLTOALL
    """The all-to-all module this release builds, and where it keeps it."""

    def aot_library(self, module: str | None = None) -> Path:
        """``flashinfer/data/aot/<module>/<module>.so`` (``jit_env.FLASHINFER_AOT_DIR``);
        ``module`` defaults to this release's all-to-all module."""
        name = module if module is not None else self.jit_module.name
        return self.package_dir / "data" / "aot" / name / f"{name}.so"


def find_flashinfer() -> FlashInferInstall:
    """The installed flashinfer-python, checked to be the release the backend drives.

    Raises:
        FlashInferMissing: not importable, no distribution metadata, or its
            all-to-all sources (``data/csrc``) are missing.
        FlashInferVersionMismatch: another release.
    """
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise FlashInferMissing(
            f"flashinfer-python is not installed: prewarm needs flashinfer-python "
            f"{SUPPORTED_FLASHINFER}, the client's flashinfer extra ({_INSTALL_HINT})"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    try:
        version = importlib.metadata.version(FLASHINFER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise FlashInferMissing(
            f"flashinfer is importable from {package_dir} but no {FLASHINFER_DISTRIBUTION} "
            f"distribution is installed; install flashinfer-python {SUPPORTED_FLASHINFER} "
            f"({_INSTALL_HINT})"
        ) from error
    jit_module = JIT_MODULES.get(version)
    if jit_module is None:
        raise FlashInferVersionMismatch(
            f"flashinfer-python {version} is installed; the client's all-to-all backend "
            f"drives {SUPPORTED_FLASHINFER} (0.7.4 removed MoeAlltoAll): "
            f"pip install flashinfer-python=={SUPPORTED_FLASHINFER} ({_INSTALL_HINT})"
        )
    source = package_dir / jit_module.source
    if not source.is_file():
        raise FlashInferMissing(
            f"{package_dir} lacks {source.relative_to(package_dir)}: this flashinfer-python "
            "install has no source for the all-to-all module to compile"
        )
    return FlashInferInstall(version=version, package_dir=package_dir, jit_module=jit_module)
