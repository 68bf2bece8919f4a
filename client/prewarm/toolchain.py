"""The tools FlashInfer compiles with (nvcc, ninja, the C++ compiler), found as FlashInfer finds them.

Nothing here imports FlashInfer: a missing tool is reported before a build
process starts, in words that say what to install or set.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from moe_sidecar.client.prewarm.errors import ToolMissing

__all__ = ["CudaToolkit", "Which", "env_warnings", "find_build_tools", "find_cuda_toolkit"]


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


def env_warnings(env: Mapping[str, str]) -> list[str]:
    """What in ``env`` makes the inference processes miss or rebuild what ``prewarm`` builds."""
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
