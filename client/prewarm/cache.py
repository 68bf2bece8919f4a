"""FlashInfer's JIT cache: where a release keeps a module, and what makes a build found again.

A FlashInfer release compiles a JIT module into a directory under
``$FLASHINFER_WORKSPACE_BASE`` (default ``$HOME``) that its version and the
set of CUDA architectures the process targets name. Each release's rule is
one :data:`CacheLayout` function; the module it is for, its sources and the
JIT spec that builds it make one :class:`JitModule` (one per release,
listed in :data:`moe_sidecar.client.prewarm.install.JIT_MODULES`, the one
table of which release has which module: ``prewarm`` builds from it and an
inference rank's JIT-cache report reads it).

The module is found again only if the inference process regenerates the same
build commands: FlashInfer runs ninja at every first load, which recompiles
when a command or an input changed. Same FlashInfer install path, same
``CUDA_HOME`` (or nvcc on ``PATH``), same torch, same cache path and the same
``FLASHINFER_*`` build variables (see :data:`BUILD_ENV`): in practice, the
same image, or the same virtualenv on the same machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from moe_sidecar.client.prewarm.archs import CudaArch

__all__ = [
    "BUILD_ENV",
    "ENV_WORKSPACE_BASE",
    "CacheLayout",
    "CachePaths",
    "JitModule",
    "flashinfer_cache_dir",
    "workspace_base",
]

ENV_WORKSPACE_BASE = "FLASHINFER_WORKSPACE_BASE"

BUILD_ENV = (
    "CUDA_HOME",
    "CUDA_PATH",
    "CC",
    "CXX",
    "FLASHINFER_NVCC",
    "FLASHINFER_NVCC_THREADS",
    "FLASHINFER_EXTRA_CFLAGS",
    "FLASHINFER_EXTRA_CUDAFLAGS",
    "FLASHINFER_EXTRA_LDFLAGS",
    "FLASHINFER_JIT_DEBUG",
    "FLASHINFER_JIT_VERBOSE",
    "FLASHINFER_JIT_LINEINFO",
    "FLASHINFER_CXX_LAUNCHER",
    "FLASHINFER_NVCC_LAUNCHER",
)
"""Variables that change the commands FlashInfer writes into the module's
``build.ninja``. An inference process whose values differ recompiles."""


def workspace_base(env: Mapping[str, str], home: Path | None = None) -> Path:
    """``FLASHINFER_WORKSPACE_BASE``, else the home directory, as FlashInfer picks it."""
    if ENV_WORKSPACE_BASE in env:
        return Path(env[ENV_WORKSPACE_BASE])
    return home if home is not None else Path.home()


def flashinfer_cache_dir(base: Path) -> Path:
    """``<FLASHINFER_WORKSPACE_BASE>/.cache/flashinfer``: every version and target set."""
    return base / ".cache" / "flashinfer"


@dataclass(frozen=True)
class CachePaths:
    """Where FlashInfer keeps one module for one set of targets."""

    base: Path
    """``FLASHINFER_WORKSPACE_BASE``."""
    cache_dir: Path
    """``<base>/.cache/flashinfer``: every version and target set."""
    workspace_dir: Path
    """``<cache_dir>/<version>/<archs>``."""
    jit_dir: Path
    """``<workspace_dir>/cached_ops``: FlashInfer's ``FLASHINFER_JIT_DIR``."""
    module_dir: Path
    """``<jit_dir>/<module>``: build.ninja, objects, ninja's logs, the library."""
    library: Path
    """``<module_dir>/<module>.so``: what FlashInfer loads."""
    lock: Path
    """``<jit_dir>/tmp/<module>.lock``: FlashInfer's build lock."""


CacheLayout: TypeAlias = Callable[[Path, str, Iterable[CudaArch], str], CachePaths]
"""One release's rule: ``(base, version, archs, module)`` to the paths it uses."""


@dataclass(frozen=True)
class JitModule:
    """The all-to-all JIT module of one FlashInfer release, and that release's cache rule."""

    flashinfer_version: str
    """The flashinfer-python release (its distribution's version) this entry is for."""
    name: str
    """The JIT module's name: its directory and library in the cache."""
    role: str
    """What the module is, for the report: whose all-to-all it is."""
    sources: tuple[str, ...]
    """The module's own source files, relative to the flashinfer package (the
    rest are FlashInfer's shared headers): an install without one of them
    cannot compile the module."""
    spec_factory: str
    """``package.module:function`` returning FlashInfer's JIT spec of the module;
    a string, because the build process imports it and an inference rank's
    cache report calls it (neither is this module's business)."""
    layout: CacheLayout
    """Where this release keeps the module."""

    def paths(self, base: Path, version: str, archs: Iterable[CudaArch]) -> CachePaths:
        """This release's paths of the module for ``archs`` under ``base``."""
        return self.layout(base, version, archs, self.name)
