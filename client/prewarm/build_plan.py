"""What ``prewarm`` builds: one target per set of architectures, and why each is built or skipped.

Pure: the file test is an argument.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moe_sidecar.client.prewarm.archs import CudaArch, sorted_archs
from moe_sidecar.client.prewarm.cache import CachePaths, JitModule, flashinfer_cache_dir
from moe_sidecar.client.prewarm.errors import ArchError
from moe_sidecar.client.prewarm.install import DEFAULT_JIT_MODULE

__all__ = ["ArchSource", "BuildPlan", "Target", "TargetStatus", "make_plan"]

TargetStatus = Literal["to-build", "already-built", "ahead-of-time"]
ArchSource = Literal["--arch", "FLASHINFER_CUDA_ARCH_LIST", "visible GPUs", "default list"]


@dataclass(frozen=True)
class Target:
    """One build: a set of architectures, its paths, and what the plan does with it."""

    archs: frozenset[CudaArch]
    paths: CachePaths
    status: TargetStatus
    jit_module: JitModule = DEFAULT_JIT_MODULE
    """The module built (its JIT spec is what the build process runs)."""

    @property
    def label(self) -> str:
        """``9.0a``, or ``9.0a+10.0a`` for a multi-architecture set."""
        return "+".join(a.label for a in sorted_archs(self.archs))


@dataclass(frozen=True)
class BuildPlan:
    """What ``prewarm`` builds, where, and why those architectures."""

    flashinfer_version: str
    jit_module: JitModule
    base: Path
    arch_source: ArchSource
    targets: tuple[Target, ...]
    aot_library: Path | None
    """FlashInfer's ahead-of-time copy, when one exists: it is loaded instead of the cache."""
    warnings: tuple[str, ...] = ()
    package_dir: Path | None = None
    """The flashinfer package the plan is for (its sources are compiled)."""

    @property
    def module(self) -> str:
        """The JIT module's name (``mnnvl_moe_alltoall``)."""
        return self.jit_module.name

    @property
    def cache_dir(self) -> Path:
        """``<base>/.cache/flashinfer``."""
        return flashinfer_cache_dir(self.base)

    @property
    def to_build(self) -> tuple[Target, ...]:
        """The targets a build process will run for."""
        return tuple(t for t in self.targets if t.status == "to-build")


def make_plan(
    targets: Sequence[frozenset[CudaArch]],
    *,
    base: Path,
    version: str,
    arch_source: ArchSource,
    aot_library: Path | None = None,
    ignore_aot: bool = False,
    refresh: bool = False,
    jit_module: JitModule = DEFAULT_JIT_MODULE,
    exists: Callable[[Path], bool] = Path.exists,
    warnings: Sequence[str] = (),
    package_dir: Path | None = None,
) -> BuildPlan:
    """Decides per target: build it, skip it as already built, or skip it
    because FlashInfer ships the module ahead of time.

    Args:
        targets: one set of architectures per build.
        base: ``FLASHINFER_WORKSPACE_BASE``.
        version: FlashInfer's version (its cache directory's name).
        arch_source: where the targets came from (reported).
        aot_library: ``flashinfer/data/aot/<module>/<module>.so``; when it
            exists FlashInfer loads it whatever the cache holds.
        ignore_aot: build into the cache even when the AOT copy exists.
        refresh: run FlashInfer's build for targets already built too (ninja
            recompiles only what changed).
        jit_module: the JIT module and its release's cache rule.
        exists: the file test (``Path.exists``).
        warnings: carried into the plan.
        package_dir: the flashinfer package (carried into the plan).

    Raises:
        ArchError: no target.
    """
    if not targets:
        raise ArchError("no CUDA architecture to build for")
    aot = aot_library if aot_library is not None and exists(aot_library) else None
    planned = []
    for archs in targets:
        paths = jit_module.paths(base, version, archs)
        status: TargetStatus
        if aot is not None and not ignore_aot:
            status = "ahead-of-time"
        elif exists(paths.library) and not refresh:
            status = "already-built"
        else:
            status = "to-build"
        planned.append(Target(archs, paths, status, jit_module))
    return BuildPlan(
        flashinfer_version=version,
        jit_module=jit_module,
        base=base,
        arch_source=arch_source,
        targets=tuple(planned),
        aot_library=aot,
        warnings=tuple(warnings),
        package_dir=package_dir,
    )
