"""``moe-sidecar prewarm``: compile FlashInfer's all-to-all module ahead of time.

The first use of FlashInfer's ``MoeAlltoAll`` in a machine JIT-compiles the
CUDA module ``mnnvl_moe_alltoall`` (about 190 s on an H200 host) into
FlashInfer's cache. ``prewarm`` builds exactly that module (the one the
client's ``flashinfer`` backend loads: ``MoeAlltoAll(backend="trtllm")``,
which is also what ``flashinfer.moe_ep``'s ``NVLinkOneSidedAlltoAll`` builds
on) with FlashInfer's own build code, into the very directory an inference
process will look in, on a machine with nvcc and no GPU (an image build, an
init container). With FlashInfer 0.7.4 installed it builds that release's
module instead, ``nvlink_one_sided_alltoall`` (83 s measured on an H200
host), the one behind 0.7.4's ``NVLinkOneSidedAlltoAll`` and the client's
``flashinfer-moe-ep`` backend: same cache rules, same build variables
(:data:`~moe_sidecar.client.backends.jit_cache.ALLTOALL_MODULES`).

Where FlashInfer 0.7.2.post1 looks (``flashinfer/jit/env.py``)::

    $FLASHINFER_WORKSPACE_BASE (default $HOME)
      /.cache/flashinfer/<flashinfer version>/<archs>/cached_ops/mnnvl_moe_alltoall/mnnvl_moe_alltoall.so

``<archs>`` is the *set* of CUDA architectures the process targets, sorted and
joined: ``90a`` for a process that sees H100/H200 GPUs, ``100a`` for B200,
``90a_100a`` only for a process that sees both at once (or whose
``FLASHINFER_CUDA_ARCH_LIST`` says ``9.0a 10.0a``). So each architecture is
its own build in its own directory, and a cache made for ``9.0a 10.0a``
together would not be found by a process on an H200 node. A module copied to
``flashinfer/data/aot/<name>/<name>.so`` is loaded instead of the cache.

The module is found again only if the inference process regenerates the same
build commands: FlashInfer runs ninja at every first load, which recompiles
when a command or an input changed. Same FlashInfer install path, same
``CUDA_HOME`` (or nvcc on ``PATH``), same torch, same cache path and the same
``FLASHINFER_*`` build variables (see :data:`BUILD_ENV`): in practice, the
same image, or the same virtualenv on the same machine.

This module has two halves. The pure half (architecture parsing and
normalising, cache path computation, the plan) and the environment probes
never import FlashInfer. The build half runs each build in a child process
(:func:`_worker_main`) that imports FlashInfer with ``CUDA_VISIBLE_DEVICES=``
and ``FLASHINFER_CUDA_ARCH_LIST`` set to the target's architectures and calls
the JIT spec's ``build()`` under FlashInfer's own lock file
(``<cached_ops>/tmp/mnnvl_moe_alltoall.lock``), so a concurrent inference
process and ``prewarm`` never compile at once; it never loads the module,
which needs a GPU driver.

Exit status of :func:`run_cli`: 0 when every target is compiled (now or
before) or shipped ahead of time; 1 when a build failed or timed out; 2 for a
bad flag or a missing prerequisite (torch, flashinfer-python 0.7.2.post1 or 0.7.4,
nvcc, ninja, a C++ compiler); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Literal

from moe_sidecar.client.backends.jit_cache import ALLTOALL_MODULES, AlltoAllModule

__all__ = [
    "BUILD_ENV",
    "DEFAULT_ARCHS",
    "ENV_ARCH_LIST",
    "ENV_WORKSPACE_BASE",
    "FLASHINFER_DISTRIBUTION",
    "MODULE_NAME",
    "ArchError",
    "BuildFailed",
    "CachePaths",
    "CudaArch",
    "CudaToolkit",
    "FlashInferInstall",
    "FlashInferMissing",
    "FlashInferVersionMismatch",
    "Plan",
    "PrewarmError",
    "Target",
    "TargetResult",
    "ToolMissing",
    "arch_dir_name",
    "build_target",
    "cache_paths",
    "find_build_tools",
    "find_cuda_toolkit",
    "find_flashinfer",
    "flashinfer_cache_dir",
    "make_plan",
    "normalize_capability",
    "parse_arch",
    "parse_arch_flags",
    "parse_flashinfer_arch_list",
    "run_cli",
    "visible_gpu_archs",
    "workspace_base",
]

MODULE_NAME = "mnnvl_moe_alltoall"
"""FlashInfer's JIT module behind ``MoeAlltoAll(backend="trtllm")`` (its default)."""

FLASHINFER_DISTRIBUTION = "flashinfer-python"

ENV_ARCH_LIST = "FLASHINFER_CUDA_ARCH_LIST"
ENV_WORKSPACE_BASE = "FLASHINFER_WORKSPACE_BASE"

DEFAULT_ARCHS = ("9.0a", "10.0a")
"""Built when no ``--arch``, no ``FLASHINFER_CUDA_ARCH_LIST`` and no GPU is
given: Hopper (H100, H200, GH200) and Blackwell (B200, GB200), the GPUs with
the NVLink the one-sided all-to-all is for. Each is its own build (a process
on a node of one kind looks in that kind's directory); B300/GB300 is
``10.3a``."""

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

# FlashInfer's minimum (flashinfer.jit.core.check_cuda_arch): sm75.
_MIN_CAPABILITY = (7, 5)
_PROGRESS_EVERY_LOG = 10.0
_PROGRESS_EVERY_TTY = 1.0
_ERROR_TAIL_LINES = 40


# --- errors --------------------------------------------------------------------------


class PrewarmError(Exception):
    """``prewarm`` cannot run here; :attr:`exit_status` is what the CLI returns."""

    exit_status = 2


class ArchError(PrewarmError, ValueError):
    """A CUDA architecture that FlashInfer would not accept or cannot be normalised."""


class FlashInferMissing(PrewarmError):
    """flashinfer-python is not installed (or not as a distribution)."""


class FlashInferVersionMismatch(PrewarmError):
    """Another flashinfer-python release than the one the backend drives."""


class ToolMissing(PrewarmError):
    """nvcc, ninja or the C++ compiler FlashInfer calls is not there."""


class BuildFailed(PrewarmError):
    """FlashInfer's build of a target failed or timed out."""

    exit_status = 1


# --- CUDA architectures (pure) -------------------------------------------------------


@dataclass(frozen=True, order=True)
class CudaArch:
    """One CUDA target as FlashInfer keeps it: ``(9, "0a")`` is ``sm_90a``."""

    major: int
    minor: str
    """The minor digit and its suffix: ``"0"``, ``"0a"`` (arch-specific) or ``"0f"`` (family)."""

    @property
    def label(self) -> str:
        """``9.0a``: the ``FLASHINFER_CUDA_ARCH_LIST`` and ``--arch`` spelling."""
        return f"{self.major}.{self.minor}"

    @property
    def dir_part(self) -> str:
        """``90a``: this target's part of FlashInfer's cache directory name."""
        return f"{self.major}{self.minor}"

    @property
    def digit(self) -> int:
        return int(self.minor[0])

    @property
    def suffix(self) -> str:
        return self.minor[1:]

    def __str__(self) -> str:
        return self.label


def _sorted(archs: Iterable[CudaArch]) -> list[CudaArch]:
    # FlashInfer sorts (major, minor) tuples: an int, then a string.
    return sorted(archs, key=lambda a: (a.major, a.minor))


def arch_dir_name(archs: Iterable[CudaArch]) -> str:
    """FlashInfer's directory name for a set of targets: ``90a``, ``90a_100a``."""
    return "_".join(a.dir_part for a in _sorted(archs))


def normalize_capability(
    major: int, minor: int, cuda_version: tuple[int, int] | None = None
) -> CudaArch:
    """The target FlashInfer builds for a GPU of compute capability ``major.minor``.

    Mirrors ``CompilationContext._normalize_cuda_arch`` of FlashInfer
    0.7.2.post1: 9.x and 10.x or newer get the arch-specific ``a`` suffix,
    12.0 gets ``f`` with CUDA 12.9+ (``a`` with 12.8), older GPUs none.

    Args:
        major: the compute capability's major number.
        minor: its minor number (one digit).
        cuda_version: the toolkit's (major, minor); needed only for 12.x.

    Raises:
        ArchError: below sm75, or a 12.x target whose suffix depends on a
            CUDA version that is unknown or too old.
    """
    if not 0 <= minor <= 9:
        raise ArchError(f"compute capability {major}.{minor}: the minor must be one digit")
    if (major, minor) < _MIN_CAPABILITY:
        raise ArchError(
            f"compute capability {major}.{minor}: FlashInfer needs sm75 or newer "
            "(the all-to-all is for Hopper 9.0a and Blackwell 10.0a)"
        )
    if major == 12:
        if cuda_version is None:
            raise ArchError(
                f"{major}.{minor}: FlashInfer's suffix for 12.x depends on the CUDA version, "
                "which is unknown here (no nvcc); give it explicitly, e.g. 12.0f"
            )
        if minor == 0:
            if cuda_version >= (12, 9):
                return CudaArch(12, "0f")
            if cuda_version >= (12, 8):
                return CudaArch(12, "0a")
            raise ArchError("SM 120 needs CUDA 12.8 or newer")
        if cuda_version >= (12, 9):
            return CudaArch(12, f"{minor}a")
        raise ArchError("SM 12.1+ needs CUDA 12.9 or newer")
    if major >= 9:
        return CudaArch(major, f"{minor}a")
    return CudaArch(major, str(minor))


_DOTTED = re.compile(r"(\d{1,2})\.(\d)([af]?)")
_COMPACT = re.compile(r"(?:sm_?|compute_)?(\d{1,2})(\d)([af]?)")


def parse_arch(text: str, *, cuda_version: tuple[int, int] | None = None) -> CudaArch:
    """One architecture: ``9.0a``, ``9.0``, ``90a``, ``sm90a``, ``sm_100a``, ``compute_100a``.

    Without a suffix, the suffix is FlashInfer's for a GPU of that capability
    (``9.0`` -> ``9.0a``, see :func:`normalize_capability`); a given suffix is
    kept as FlashInfer keeps it.

    Raises:
        ArchError: not an architecture, below sm75, or a suffix that does not
            exist for it (``a`` needs 9.0+, ``f`` needs 10.0+).
    """
    stripped = text.strip().lower()
    match = _DOTTED.fullmatch(stripped) or _COMPACT.fullmatch(stripped)
    if match is None:
        raise ArchError(
            f"--arch {text!r}: not a CUDA architecture (examples: 9.0a, 10.0a, 90a, sm_100a)"
        )
    major, digit, suffix = int(match.group(1)), int(match.group(2)), match.group(3)
    if not suffix:
        return normalize_capability(major, digit, cuda_version)
    if (major, digit) < _MIN_CAPABILITY:
        raise ArchError(f"--arch {text!r}: FlashInfer needs sm75 or newer")
    if suffix == "a" and major < 9:
        raise ArchError(f"--arch {text!r}: arch-specific 'a' targets start at 9.0a")
    if suffix == "f" and major < 10:
        raise ArchError(f"--arch {text!r}: family 'f' targets start at 10.0f")
    return CudaArch(major, f"{digit}{suffix}")


def parse_arch_flags(
    values: Sequence[str], *, cuda_version: tuple[int, int] | None = None
) -> tuple[frozenset[CudaArch], ...]:
    """The targets named by ``--arch`` values, in order, duplicates dropped.

    Each value is a comma- or space-separated list; each item is one target;
    ``+`` joins architectures into one target for a process that sees GPUs of
    several kinds at once (``9.0a+10.0a``: FlashInfer's ``90a_100a``).

    Raises:
        ArchError: an item is not an architecture, or nothing was named.
    """
    targets: list[frozenset[CudaArch]] = []
    for value in values:
        for item in re.split(r"[,\s]+", value.strip()):
            if not item:
                continue
            target = frozenset(
                parse_arch(part, cuda_version=cuda_version) for part in item.split("+")
            )
            if target not in targets:
                targets.append(target)
    if not targets:
        raise ArchError("--arch: no architecture given")
    return tuple(targets)


def parse_flashinfer_arch_list(
    value: str, *, cuda_version: tuple[int, int] | None = None
) -> frozenset[CudaArch]:
    """``FLASHINFER_CUDA_ARCH_LIST`` as FlashInfer reads it: one set of targets.

    FlashInfer splits it on single spaces, keeps ``M.m`` items that end in a
    letter as they are and normalises the others; a process with this
    variable set uses the whole set as one cache directory.

    Raises:
        ArchError: a value FlashInfer itself would fail on (commas, double
            spaces, not ``M.m``) or a target below sm75.
    """
    archs: set[CudaArch] = set()
    for item in value.split(" "):
        match = re.fullmatch(r"(\d+)\.(\d)([a-z]?)", item)
        if match is None:
            raise ArchError(
                f"{ENV_ARCH_LIST}={value!r}: FlashInfer reads it as items like '9.0a' "
                f"separated by single spaces; {item!r} is not one"
            )
        major, digit, suffix = int(match.group(1)), int(match.group(2)), match.group(3)
        if suffix:
            if (major, digit) < _MIN_CAPABILITY:
                raise ArchError(f"{ENV_ARCH_LIST}: {item}: FlashInfer needs sm75 or newer")
            archs.add(CudaArch(major, f"{digit}{suffix}"))
        else:
            archs.add(normalize_capability(major, digit, cuda_version))
    return frozenset(archs)


def visible_gpu_archs(cuda_version: tuple[int, int] | None = None) -> frozenset[CudaArch]:
    """The targets of the GPUs this process sees, as FlashInfer derives them (torch).

    Empty with no GPU, with ``CUDA_VISIBLE_DEVICES=``, or with a CPU build of torch.

    Raises:
        ArchError: a GPU whose target cannot be normalised (see
            :func:`normalize_capability`).
    """
    import torch

    if not torch.cuda.is_available():
        return frozenset()
    return frozenset(
        normalize_capability(*torch.cuda.get_device_capability(i), cuda_version)
        for i in range(torch.cuda.device_count())
    )


# --- cache paths (pure) --------------------------------------------------------------


def workspace_base(env: Mapping[str, str], home: Path | None = None) -> Path:
    """``FLASHINFER_WORKSPACE_BASE``, else the home directory, as FlashInfer picks it."""
    if ENV_WORKSPACE_BASE in env:
        return Path(env[ENV_WORKSPACE_BASE])
    return home if home is not None else Path.home()


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


def flashinfer_cache_dir(base: Path) -> Path:
    """``<FLASHINFER_WORKSPACE_BASE>/.cache/flashinfer``: every version and target set."""
    return base / ".cache" / "flashinfer"


def cache_paths(
    base: Path, version: str, archs: Iterable[CudaArch], module: str = MODULE_NAME
) -> CachePaths:
    """The paths FlashInfer ``version`` uses for ``module`` built for ``archs``
    under ``FLASHINFER_WORKSPACE_BASE=base`` (``flashinfer/jit/env.py`` and
    ``JitSpecNvcc`` of 0.7.2.post1)."""
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


# --- the plan (pure) -----------------------------------------------------------------

TargetStatus = Literal["to-build", "already-built", "ahead-of-time"]
ArchSource = Literal["--arch", "FLASHINFER_CUDA_ARCH_LIST", "visible GPUs", "default list"]


@dataclass(frozen=True)
class Target:
    """One build: a set of architectures, its paths, and what the plan does with it."""

    archs: frozenset[CudaArch]
    paths: CachePaths
    status: TargetStatus

    @property
    def label(self) -> str:
        """``9.0a``, or ``9.0a+10.0a`` for a multi-architecture set."""
        return "+".join(a.label for a in _sorted(self.archs))


@dataclass(frozen=True)
class Plan:
    """What ``prewarm`` builds, where, and why those architectures."""

    flashinfer_version: str
    module: str
    base: Path
    arch_source: ArchSource
    targets: tuple[Target, ...]
    aot_library: Path | None
    """FlashInfer's ahead-of-time copy, when one exists: it is loaded instead of the cache."""
    warnings: tuple[str, ...] = ()
    package_dir: Path | None = None
    """The flashinfer package the plan is for (its sources are compiled)."""

    @property
    def cache_dir(self) -> Path:
        """``<base>/.cache/flashinfer``."""
        return flashinfer_cache_dir(self.base)

    @property
    def to_build(self) -> tuple[Target, ...]:
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
    module: str = MODULE_NAME,
    exists: Callable[[Path], bool] = Path.exists,
    warnings: Sequence[str] = (),
    package_dir: Path | None = None,
) -> Plan:
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
        module: the JIT module's name.
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
        paths = cache_paths(base, version, archs, module)
        status: TargetStatus
        if aot is not None and not ignore_aot:
            status = "ahead-of-time"
        elif exists(paths.library) and not refresh:
            status = "already-built"
        else:
            status = "to-build"
        planned.append(Target(archs, paths, status))
    return Plan(
        flashinfer_version=version,
        module=module,
        base=base,
        arch_source=arch_source,
        targets=tuple(planned),
        aot_library=aot,
        warnings=tuple(warnings),
        package_dir=package_dir,
    )


# --- the environment (no FlashInfer import) ------------------------------------------


@dataclass(frozen=True)
class FlashInferInstall:
    """The installed flashinfer-python, found without importing it."""

    version: str
    package_dir: Path
    """The ``flashinfer`` package directory, resolved as FlashInfer resolves it."""

    @property
    def module(self) -> AlltoAllModule:
        """The all-to-all JIT module of this release (:data:`ALLTOALL_MODULES`)."""
        return ALLTOALL_MODULES[self.version]

    def aot_library(self, module: str | None = None) -> Path:
        """``flashinfer/data/aot/<module>/<module>.so`` (``jit_env.FLASHINFER_AOT_DIR``);
        ``module`` defaults to this release's all-to-all module."""
        name = self.module.name if module is None else module
        return self.package_dir / "data" / "aot" / name / f"{name}.so"


def find_flashinfer() -> FlashInferInstall:
    """The installed flashinfer-python, checked to be a release the client drives.

    Raises:
        FlashInferMissing: not importable, no distribution metadata, or its
            all-to-all sources (``data/csrc``) are missing.
        FlashInferVersionMismatch: another release.
    """
    releases = " or ".join(ALLTOALL_MODULES)
    install_hint = "pip install 'moe-sidecar[flashinfer]' or 'moe-sidecar[flashinfer074]'"
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise FlashInferMissing(
            f"flashinfer-python is not installed: prewarm needs flashinfer-python "
            f"{releases}, the client's flashinfer extras ({install_hint})"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    try:
        version = importlib.metadata.version(FLASHINFER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise FlashInferMissing(
            f"flashinfer is importable from {package_dir} but no {FLASHINFER_DISTRIBUTION} "
            f"distribution is installed; install flashinfer-python {releases} "
            f"({install_hint})"
        ) from error
    if version not in ALLTOALL_MODULES:
        raise FlashInferVersionMismatch(
            f"flashinfer-python {version} is installed; the client's all-to-all backends "
            f"drive {releases}: "
            + " or ".join(f"pip install flashinfer-python=={r}" for r in ALLTOALL_MODULES)
        )
    for name in ALLTOALL_MODULES[version].sources:
        source = package_dir / "data" / "csrc" / name
        if not source.is_file():
            raise FlashInferMissing(
                f"{package_dir} lacks {source.relative_to(package_dir)}: this flashinfer-python "
                "install has no source for the all-to-all module to compile"
            )
    return FlashInferInstall(version=version, package_dir=package_dir)


@dataclass(frozen=True)
class CudaToolkit:
    """The CUDA toolkit FlashInfer will compile with."""

    home: Path
    """``cuda_home`` in FlashInfer's build.ninja: ``CUDA_HOME``/``CUDA_PATH``,
    else two levels above ``nvcc`` on ``PATH``, else ``/usr/local/cuda``."""
    nvcc: Path
    version: tuple[int, int] | None
    """From ``nvcc --version``; None when it could not be read."""
    warnings: tuple[str, ...] = ()


Which = Callable[[str, str | None], str | None]


def _which(name: str, path: str | None) -> str | None:
    return shutil.which(name, path=path)


def _nvcc_version(nvcc: Path) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+),", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def find_cuda_toolkit(
    env: Mapping[str, str],
    *,
    which: Which = _which,
    exists: Callable[[Path], bool] = Path.exists,
    version_of: Callable[[Path], tuple[int, int] | None] = _nvcc_version,
) -> CudaToolkit:
    """Finds the toolkit as FlashInfer's ``get_cuda_path`` does, and checks it.

    Raises:
        ToolMissing: no toolkit, or no nvcc in it.
    """
    home_value = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home_value is not None:
        home = Path(home_value)
        origin = "CUDA_HOME" if env.get("CUDA_HOME") else "CUDA_PATH"
    else:
        found = which("nvcc", env.get("PATH"))
        if found is not None:
            home = Path(os.path.dirname(os.path.dirname(found)))
            origin = f"nvcc on PATH ({found})"
        else:
            home = Path("/usr/local/cuda")
            origin = "the default /usr/local/cuda"
            if not exists(home):
                raise ToolMissing(
                    "nvcc not found: prewarm compiles with the CUDA toolkit (a CUDA *devel* "
                    "image, or set CUDA_HOME to the toolkit's root)"
                )
    nvcc = home / "bin" / "nvcc"
    if not exists(nvcc):
        raise ToolMissing(
            f"nvcc not found at {nvcc} (the CUDA home from {origin}); set CUDA_HOME to the "
            "CUDA toolkit's root"
        )
    warnings = []
    libs = home / "lib64"
    if not exists(libs / "libcudart.so"):
        warnings.append(
            f"FlashInfer links the module with -L{libs} -lcudart, and {libs / 'libcudart.so'} "
            f"is missing (CUDA home from {origin}): the link may fail; set CUDA_HOME to the "
            "toolkit's root (and use the same value in the inference processes)"
        )
    if not exists(libs / "stubs" / "libcuda.so") and not exists(libs / "libcuda.so"):
        warnings.append(
            f"FlashInfer links the module with -lcuda and neither {libs / 'stubs'} nor {libs} "
            "has libcuda.so: without a GPU driver the link may fail"
        )
    return CudaToolkit(home=home, nvcc=nvcc, version=version_of(nvcc), warnings=tuple(warnings))


def find_build_tools(
    env: Mapping[str, str], *, which: Which = _which, python_bin: Path | None = None
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Checks ninja and the C++ compiler; returns the worker's PATH additions and warnings.

    FlashInfer runs ``ninja`` from ``PATH`` (the ``ninja`` wheel puts it next
    to the virtualenv's python) and compiles ``.cpp`` sources and links with
    ``$CXX`` (default ``c++``).

    Raises:
        ToolMissing: no ninja anywhere, or no C++ compiler.
    """
    path = env.get("PATH")
    extra_env: dict[str, str] = {}
    warnings: list[str] = []
    if which("ninja", path) is None:
        here = python_bin if python_bin is not None else Path(sys.executable).parent
        if which("ninja", str(here)) is None:
            raise ToolMissing(
                "ninja not found on PATH: FlashInfer builds with it (pip install ninja, a "
                "dependency of flashinfer-python, or the distribution's ninja-build)"
            )
        extra_env["PATH"] = f"{here}{os.pathsep}{path}" if path else str(here)
        warnings.append(
            f"ninja is not on PATH; this build uses {here / 'ninja'}. FlashInfer runs ninja at "
            f"every first load in the inference processes too: put {here} on their PATH"
        )
    cxx = env.get("CXX", "c++")
    if which(cxx, path) is None and not Path(cxx).is_file():
        raise ToolMissing(
            f"the C++ compiler {cxx!r} (CXX, default c++) was not found: FlashInfer compiles "
            "the module's .cpp sources and links with it (install g++)"
        )
    return extra_env, tuple(warnings)


def _env_warnings(env: Mapping[str, str]) -> list[str]:
    warnings = []
    if env.get("FLASHINFER_DISABLE_JIT"):
        warnings.append(
            "FLASHINFER_DISABLE_JIT is set: FlashInfer then loads only ahead-of-time modules "
            "and never the JIT cache this command fills; unset it in the inference processes "
            "(this build ignores it)"
        )
    if env.get("FLASHINFER_JIT_VERBOSE") == "1" and "FLASHINFER_JIT_DEBUG" not in env:
        warnings.append(
            "FLASHINFER_JIT_VERBOSE=1 makes FlashInfer compile a debug build (-O0 -g); use "
            "--verbose to see the compiler's output instead"
        )
    return warnings


# --- building (child processes) ------------------------------------------------------


TargetOutcome = Literal["built", "up-to-date", "already-built", "ahead-of-time", "failed"]


@dataclass
class TargetResult:
    """What happened to one target."""

    target: Target
    outcome: TargetOutcome
    seconds: float = 0.0
    library_bytes: int | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        paths = self.target.paths
        return {
            "archs": [a.label for a in _sorted(self.target.archs)],
            "label": self.target.label,
            "outcome": self.outcome,
            "library": str(paths.library),
            "workspace_dir": str(paths.workspace_dir),
            "seconds": round(self.seconds, 3),
            "library_bytes": self.library_bytes,
            "error": self.error,
            "notes": self.notes,
        }


def _file_stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_mtime_ns, st.st_size)


def _worker_main(argv: Sequence[str] | None = None) -> None:
    """Child process: builds the module with FlashInfer's own JIT spec.

    Runs with ``FLASHINFER_CUDA_ARCH_LIST`` and ``FLASHINFER_WORKSPACE_BASE``
    set by the parent and ``CUDA_VISIBLE_DEVICES=``; argv[0] is a JSON object
    ``{"result": path, "library": expected path, "verbose": bool}``. Writes a
    JSON result there and exits 0 (built or up to date) or 1.
    """
    request = json.loads((sys.argv[1:] if argv is None else argv)[0])
    result: dict[str, Any] = {}
    code = 1
    try:
        jit_env = importlib.import_module("flashinfer.jit.env")
        jit_comm = importlib.import_module("flashinfer.jit.comm")
        filelock = importlib.import_module("filelock")
        if "package_dir" in request:
            imported = Path(str(jit_comm.__file__)).resolve().parents[1]
            if imported != Path(request["package_dir"]):
                raise RuntimeError(
                    f"the build process imports flashinfer from {imported}, not from "
                    f"{request['package_dir']}"
                )
        # The module of the release the child imports (the parent checked the
        # same release and, with package_dir, the same install).
        module = ALLTOALL_MODULES[str(jit_env.flashinfer_version)]
        spec = getattr(jit_comm, module.generator)()
        library = Path(spec.jit_library_path)
        result["library"] = str(library)
        result["jit_dir"] = str(jit_env.FLASHINFER_JIT_DIR)
        if library != Path(request["library"]):
            raise RuntimeError(
                f"FlashInfer builds {spec.name} into {library}, but prewarm computed "
                f"{request['library']}: this FlashInfer lays out its cache differently"
            )
        # FlashInfer's own lock: an inference process (or another prewarm)
        # building the same module waits for this one, and vice versa.
        with filelock.FileLock(str(spec.lock_path), thread_local=False):
            before = _file_stamp(library)
            started = time.monotonic()
            spec.build(verbose=bool(request["verbose"]), need_lock=False)
            result["seconds"] = time.monotonic() - started
            after = _file_stamp(library)
        if after is None:
            raise RuntimeError(f"FlashInfer's build finished without writing {library}")
        result["compiled"] = before != after
        result["library_bytes"] = after[1]
        result["aot"] = [str(a.path) for a in getattr(spec, "aot_artifacts", ())]
        code = 0
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
    Path(request["result"]).write_text(json.dumps(result))
    sys.exit(code)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Ends the worker and everything it started (ninja, nvcc): its own session."""
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(text: str, lines: int = _ERROR_TAIL_LINES) -> str:
    kept = text.rstrip().splitlines()
    if len(kept) <= lines:
        return "\n".join(kept)
    return "\n".join([f"[... {len(kept) - lines} lines ...]", *kept[-lines:]])


def build_target(
    target: Target,
    *,
    env: Mapping[str, str],
    verbose: bool = False,
    timeout: float = 1800.0,
    progress: IO[str] | None = None,
    progress_every: float | None = None,
    package_dir: Path | None = None,
) -> TargetResult:
    """Builds one target in a child process, printing elapsed time while it runs.

    Args:
        target: the target (its paths decide ``FLASHINFER_WORKSPACE_BASE``).
        env: the environment the child starts from (build variables included).
        verbose: let ninja/nvcc print to this process's stderr.
        timeout: seconds before the build is stopped.
        progress: where the progress line goes (None: nowhere).
        progress_every: seconds between progress lines (default: 1 on a
            terminal, where the line is rewritten in place, else 10).
        package_dir: the flashinfer package the plan was made for; the child
            checks it imports that one.

    Raises:
        BuildFailed: the build failed or ran past ``timeout``.
    """
    child_env = dict(env)
    child_env[ENV_ARCH_LIST] = " ".join(a.label for a in _sorted(target.archs))
    child_env[ENV_WORKSPACE_BASE] = str(target.paths.base)
    # No GPU needed, and none touched: the targets come from the list above.
    child_env["CUDA_VISIBLE_DEVICES"] = ""
    child_env.pop("FLASHINFER_DISABLE_JIT", None)
    # The child imports what this process imports (this flashinfer, this torch).
    child_env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    tty = progress is not None and progress.isatty()
    every = progress_every or (_PROGRESS_EVERY_TTY if tty else _PROGRESS_EVERY_LOG)
    with tempfile.TemporaryDirectory(prefix="moe-sidecar-prewarm-") as tmp:
        result_file = Path(tmp) / "result.json"
        log_file = Path(tmp) / "build.log"
        request: dict[str, object] = {
            "result": str(result_file),
            "library": str(target.paths.library),
            "verbose": verbose,
        }
        if package_dir is not None:
            request["package_dir"] = str(package_dir)
        command = [
            sys.executable,
            "-c",
            f"from {__name__} import _worker_main; _worker_main()",
            json.dumps(request),
        ]
        started = time.monotonic()
        with open(log_file, "wb") as log:
            process = subprocess.Popen(
                command,
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=None if verbose else log,
                stderr=None if verbose else subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                next_line = started + every
                while True:
                    now = time.monotonic()
                    try:
                        process.wait(timeout=max(0.05, min(next_line, started + timeout) - now))
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    now = time.monotonic()
                    if now - started >= timeout:
                        _stop(process)
                        raise BuildFailed(
                            f"{target.label}: the build ran past --timeout {timeout:.0f} s "
                            "and was stopped"
                        )
                    if progress is not None and not verbose and now >= next_line:
                        line = (
                            f"  {target.label}: compiling {target.paths.library.stem} ... "
                            f"{now - started:.0f} s"
                        )
                        progress.write(f"\r{line}" if tty else f"{line}\n")
                        progress.flush()
                        next_line += every
            except BaseException:
                _stop(process)
                raise
            finally:
                if tty and progress is not None and not verbose:
                    progress.write("\r\033[K")
                    progress.flush()
        seconds = time.monotonic() - started
        output = "" if verbose else log_file.read_text(errors="replace")
        try:
            child: dict[str, Any] = json.loads(result_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            child = {}
    if process.returncode != 0 or "error" in child:
        detail = child.get("error") or f"the build process exited with {process.returncode}"
        if output and output.strip() not in detail:
            detail += "\n" + _tail(output)
        raise BuildFailed(f"{target.label}: {_tail(detail)}")
    result = TargetResult(
        target=target,
        outcome="built" if child.get("compiled") else "up-to-date",
        seconds=seconds,
        library_bytes=child.get("library_bytes"),
    )
    for aot in child.get("aot") or []:
        result.notes.append(f"FlashInfer loads the ahead-of-time copy {aot} instead of this cache")
    return result


# --- the command ---------------------------------------------------------------------


def _targets_and_source(
    args: argparse.Namespace, env: Mapping[str, str], cuda_version: tuple[int, int] | None
) -> tuple[tuple[frozenset[CudaArch], ...], ArchSource]:
    if args.arch:
        return parse_arch_flags(args.arch, cuda_version=cuda_version), "--arch"
    if ENV_ARCH_LIST in env:
        listed = parse_flashinfer_arch_list(env[ENV_ARCH_LIST], cuda_version=cuda_version)
        return (listed,), "FLASHINFER_CUDA_ARCH_LIST"
    gpus = visible_gpu_archs(cuda_version)
    if gpus:
        return (gpus,), "visible GPUs"
    return parse_arch_flags(DEFAULT_ARCHS, cuda_version=cuda_version), "default list"


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**20:.1f} MiB"


def _describe_plan(plan: Plan, out: IO[str]) -> None:
    out.write(
        f"FlashInfer {plan.flashinfer_version}, module {plan.module} "
        f"(the all-to-all of the client's flashinfer backend)\n"
    )
    out.write(f"  cache: {plan.cache_dir} ")
    out.write(f"({ENV_WORKSPACE_BASE}={plan.base})\n")
    out.write(f"  targets ({plan.arch_source}): {', '.join(t.label for t in plan.targets)}\n")
    for warning in plan.warnings:
        out.write(f"  warning: {warning}\n")
    if plan.aot_library is not None:
        if all(t.status == "ahead-of-time" for t in plan.targets):
            out.write(
                f"  FlashInfer ships this module ahead of time ({plan.aot_library}) and loads it "
                "instead of the cache: nothing to build (--ignore-aot builds the cache anyway)\n"
            )
        else:
            out.write(
                f"  note: FlashInfer loads the ahead-of-time copy {plan.aot_library} instead of "
                "the cache built here (--ignore-aot)\n"
            )


def _result_line(result: TargetResult) -> str:
    paths = result.target.paths
    label = f"{result.target.label:<10}"
    if result.outcome == "built":
        return (
            f"  {label} built in {result.seconds:.1f} s "
            f"({_human_bytes(result.library_bytes)}): {paths.library}"
        )
    if result.outcome == "up-to-date":
        return f"  {label} up to date (checked in {result.seconds:.1f} s): {paths.library}"
    if result.outcome == "already-built":
        return f"  {label} already built: {paths.library}"
    if result.outcome == "ahead-of-time":
        return f"  {label} shipped ahead of time: nothing to build"
    return f"  {label} FAILED after {result.seconds:.1f} s"


def _prepare(
    args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[Plan, dict[str, str], CudaToolkit | None]:
    """The plan, the worker's extra environment and the toolkit (None if not needed).

    Raises:
        PrewarmError: a bad architecture or a missing prerequisite.
    """
    try:
        toolkit: CudaToolkit | None = find_cuda_toolkit(env)
    except ToolMissing:
        toolkit = None  # needed only if something is to be built: checked below
    cuda_version = toolkit.version if toolkit is not None else None
    # Flags first: a bad --arch is reported before a missing FlashInfer.
    targets, source = _targets_and_source(args, env, cuda_version)
    install = find_flashinfer()
    base = Path(args.workspace_base) if args.workspace_base else workspace_base(env)
    plan = make_plan(
        targets,
        base=base.absolute(),
        version=install.version,
        arch_source=source,
        aot_library=install.aot_library(),
        ignore_aot=args.ignore_aot,
        refresh=args.refresh,
        warnings=_env_warnings(env),
        package_dir=install.package_dir,
        module=install.module.name,
    )
    if not plan.to_build:
        return plan, {}, None
    if toolkit is None:
        toolkit = find_cuda_toolkit(env)  # raises ToolMissing, saying why
    extra_env, tool_warnings = find_build_tools(env)
    plan = replace(plan, warnings=(*plan.warnings, *toolkit.warnings, *tool_warnings))
    return plan, extra_env, toolkit


def run_cli(args: argparse.Namespace) -> int:
    """Runs ``moe-sidecar prewarm`` with parsed ``args``; returns the exit status.

    Human-readable lines go to stdout (with ``--json``: to stderr, and one
    JSON document to stdout); the progress line goes to stderr.
    """
    env = dict(os.environ)
    text = sys.stderr if args.json else sys.stdout
    started = time.monotonic()
    try:
        plan, extra_env, toolkit = _prepare(args, env)
    except PrewarmError as error:
        print(f"moe-sidecar prewarm: {error}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "exit_status": error.exit_status, "error": str(error)}))
        return error.exit_status
    _describe_plan(plan, text)
    if toolkit is not None and plan.to_build:
        version = ".".join(map(str, toolkit.version)) if toolkit.version else "unknown version"
        text.write(f"  compiler: {toolkit.nvcc} (CUDA {version})\n")
    text.flush()

    results: list[TargetResult] = []
    failed: BuildFailed | None = None
    for target in plan.targets:
        if target.status == "ahead-of-time":
            result = TargetResult(target=target, outcome="ahead-of-time")
        elif target.status == "already-built":
            result = TargetResult(target=target, outcome="already-built")
        elif args.dry_run:
            text.write(f"  {target.label:<10} would build into {target.paths.module_dir}\n")
            continue
        else:
            text.write(f"  {target.label:<10} building into {target.paths.module_dir}\n")
            text.flush()
            try:
                result = build_target(
                    target,
                    env={**env, **extra_env},
                    verbose=args.verbose,
                    timeout=args.timeout,
                    progress=sys.stderr,
                    package_dir=plan.package_dir,
                )
            except BuildFailed as error:
                failed = error
                result = TargetResult(target=target, outcome="failed", error=str(error))
            except KeyboardInterrupt:
                print("moe-sidecar prewarm: interrupted; the build was stopped", file=sys.stderr)
                return 130
        results.append(result)
        text.write(_result_line(result) + "\n")
        for note in result.notes:
            text.write(f"    note: {note}\n")
        text.flush()
        if failed is not None:
            break

    total = time.monotonic() - started
    counts = {o: sum(1 for r in results if r.outcome == o) for o in ("built", "up-to-date")}
    counts["already built"] = sum(1 for r in results if r.outcome == "already-built")
    summary = ", ".join(f"{n} {what}" for what, n in counts.items() if n) or "nothing built"
    if failed is not None:
        print(f"moe-sidecar prewarm: {failed}", file=sys.stderr)
    else:
        text.write(f"done in {total:.1f} s: {summary}\n")
    if args.json:
        document = {
            "ok": failed is None,
            "exit_status": failed.exit_status if failed is not None else 0,
            "flashinfer": plan.flashinfer_version,
            "module": plan.module,
            "workspace_base": str(plan.base),
            "cache_dir": str(plan.cache_dir),
            "arch_source": plan.arch_source,
            "aot_library": str(plan.aot_library) if plan.aot_library else None,
            "dry_run": bool(args.dry_run),
            "targets": [r.as_json() for r in results],
            "planned": [
                {"label": t.label, "status": t.status, "library": str(t.paths.library)}
                for t in plan.targets
            ],
            "warnings": list(plan.warnings),
            "build_env": {k: env[k] for k in BUILD_ENV if k in env},
            "seconds": round(total, 3),
        }
        if failed is not None:
            document["error"] = str(failed)
        print(json.dumps(document, indent=2))
    return failed.exit_status if failed is not None else 0
