"""FlashInfer's JIT cache: where a release keeps a module, and what makes a build found again.

A FlashInfer release compiles a JIT module into a directory under
``$FLASHINFER_WORKSPACE_BASE`` (default ``$HOME``) that its version and the
set of CUDA architectures the process targets name (``flashinfer/jit/env.py``;
every release of :data:`moe_sidecar.flashinfer.RELEASES` lays it out alike)::

    $FLASHINFER_WORKSPACE_BASE (default $HOME)
      /.cache/flashinfer/<flashinfer version>/<archs>/cached_ops/<module>/<module>.so

``<archs>`` is the *set* of CUDA architectures the process targets, sorted and
joined: ``90a`` for a process that sees H100/H200 GPUs, ``100a`` for B200,
``90a_100a`` only for a process that sees both at once (or whose
``FLASHINFER_CUDA_ARCH_LIST`` says ``9.0a 10.0a``). So each architecture is
its own build in its own directory, and a cache made for ``9.0a 10.0a``
together would not be found by a process on an H200 node. A module copied to
``flashinfer/data/aot/<name>/<name>.so`` is loaded instead of the cache.

That rule is :func:`cache_paths` (a :data:`CacheLayout`); a release's module
(its name, sources and JIT spec: :attr:`moe_sidecar.flashinfer.Release.jit_module`)
with the rule makes one :class:`JitModule` (:func:`jit_module_of`).

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

from moe_sidecar.client.prewarm.archs import CudaArch, arch_dir_name
from moe_sidecar.flashinfer import DEFAULT_RELEASE, Release

__all__ = [
    "BUILD_ENV",
    "ENV_WORKSPACE_BASE",
    "MODULE_NAME",
    "CacheLayout",
    "CachePaths",
    "JitModule",
    "cache_paths",
    "flashinfer_cache_dir",
    "jit_module_of",
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


MODULE_NAME = DEFAULT_RELEASE.jit_module.name
"""The default release's all-to-all module (``cache_paths``'s default)."""


def cache_paths(
    base: Path, version: str, archs: Iterable[CudaArch], module: str = MODULE_NAME
) -> CachePaths:
    """The paths FlashInfer ``version`` uses for ``module`` built for ``archs``
    under ``FLASHINFER_WORKSPACE_BASE=base`` (``flashinfer/jit/env.py`` and
    ``JitSpecNvcc``; ``tests/fi074`` checks the newer release's own spec)."""
    cache_dir = flashinfer_cache_dir(base)
    workspace_dir = cache_dir / version / arch_dir_name(archs)
    jit_dir = workspace_dir / "cached_ops"
    module_dir = jit_dir / module
    return CachePaths(
        base=base,
        cache_dir=cache_dir,
        workspace_dir=workspace_dir,
        jit_dir=jit_dir,
        module_dir=module_dir,
        library=module_dir / f"{module}.so",
        lock=jit_dir / "tmp" / f"{module}.lock",
    )


def jit_module_of(release: Release) -> JitModule:
    """What ``prewarm`` builds for ``release``: its all-to-all module with the cache rule."""
    facts = release.jit_module
    return JitModule(
        flashinfer_version=release.name,
        name=facts.name,
        role=facts.role,
        sources=facts.sources,
        spec_factory=facts.spec_factory,
        layout=cache_paths,
    )
