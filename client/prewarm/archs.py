"""CUDA architectures as FlashInfer spells, normalises and sorts them.

Pure, except :func:`visible_gpu_archs`, which asks torch (imported inside the
call) what GPUs this process sees.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from moe_sidecar.client.prewarm.errors import ArchError

__all__ = [
    "DEFAULT_ARCHS",
    "ENV_ARCH_LIST",
    "CudaArch",
    "arch_dir_name",
    "normalize_capability",
    "parse_arch",
    "parse_arch_flags",
    "parse_flashinfer_arch_list",
    "sorted_archs",
    "visible_gpu_archs",
]

ENV_ARCH_LIST = "FLASHINFER_CUDA_ARCH_LIST"

DEFAULT_ARCHS = ("9.0a", "10.0a")
"""Built when no ``--arch``, no ``FLASHINFER_CUDA_ARCH_LIST`` and no GPU is
given: Hopper (H100, H200, GH200) and Blackwell (B200, GB200), the GPUs with
the NVLink the one-sided all-to-all is for. Each is its own build (a process
on a node of one kind looks in that kind's directory); B300/GB300 is
``10.3a``."""

# FlashInfer's minimum (flashinfer.jit.core.check_cuda_arch): sm75.
_MIN_CAPABILITY = (7, 5)


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
        """The minor digit without its suffix: ``0`` of ``0a``."""
        return int(self.minor[0])

    @property
    def suffix(self) -> str:
        """``a`` (arch-specific), ``f`` (family) or empty."""
        return self.minor[1:]

    def __str__(self) -> str:
        return self.label


def sorted_archs(archs: Iterable[CudaArch]) -> list[CudaArch]:
    """The order FlashInfer gives a set of targets (its cache directory name follows it)."""
    # FlashInfer sorts (major, minor) tuples: an int, then a string.
    return sorted(archs, key=lambda a: (a.major, a.minor))


def arch_dir_name(archs: Iterable[CudaArch]) -> str:
    """FlashInfer's directory name for a set of targets: ``90a``, ``90a_100a``."""
    return "_".join(a.dir_part for a in sorted_archs(archs))


def normalize_capability(
    major: int, minor: int, cuda_version: tuple[int, int] | None = None
) -> CudaArch:
    """The target FlashInfer builds for a GPU of compute capability ``major.minor``.

    Mirrors ``CompilationContext._normalize_cuda_arch`` of the FlashInfer
    releases of :data:`moe_sidecar.flashinfer.RELEASES`: 9.x and 10.x or newer get the arch-specific ``a`` suffix,
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
