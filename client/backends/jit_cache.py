"""Health of FlashInfer's JIT cache, seen from an inference rank.

Before the first all-to-all of a process is built, :func:`prepare_module`
asks FlashInfer where it will find its all-to-all module (the installed
release's :attr:`~moe_sidecar.flashinfer.Release.jit_module` in
:data:`moe_sidecar.flashinfer.RELEASES`, what ``prewarm`` builds)
and logs it once per process: the cache directory, and whether the module is
already compiled there, shipped ahead of time, or about to be compiled (about
3 minutes; ``moe-sidecar prewarm`` does it ahead of time). It then loads the
module through FlashInfer (``get_moe_alltoall_module()``, or the newer
release's ``get_nvlink_one_sided_alltoall_module()``, which compile when needed), times
that, and tells whether the library was written meanwhile,
i.e. whether this start paid for a compile (its own, or another process's
under FlashInfer's build lock). The result is kept for the life of the
process: the module is loaded once per process, whatever the number of EP
groups.

Everything here that touches FlashInfer imports it inside the call, never at
import time. Inspecting is best effort: a FlashInfer whose internals differ
makes the report ``None``, never a failed build.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from moe_sidecar import flashinfer

__all__ = [
    "JitCacheReport",
    "ModuleLoad",
    "inspect_jit_cache",
    "loaded_module",
    "prepare_module",
]

_log = logging.getLogger(__name__)

ModuleSource = Literal["ahead-of-time", "cache", "compile"]


@dataclass(frozen=True)
class JitCacheReport:
    """Where FlashInfer will take the all-to-all module from, before it does."""

    module: str
    """The JIT module's name (``mnnvl_moe_alltoall``)."""
    flashinfer_version: str
    archs: tuple[str, ...]
    """The CUDA targets of this process (``("9.0a",)``): they name the cache directory."""
    cache_dir: Path
    """``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``."""
    jit_dir: Path
    """``<cache_dir>/<version>/<archs>/cached_ops``."""
    library: Path
    """``<jit_dir>/<module>/<module>.so``."""
    compiled: bool
    """The library is in the cache (FlashInfer's ninja still checks it is up to date)."""
    aot_library: Path | None
    """The ahead-of-time copy FlashInfer loads instead of the cache, if any."""

    @property
    def source(self) -> ModuleSource:
        """``ahead-of-time``, ``cache`` (compiled before) or ``compile`` (not yet)."""
        if self.aot_library is not None:
            return "ahead-of-time"
        return "cache" if self.compiled else "compile"

    def describe(self) -> str:
        """One line for the log."""
        where = f"FlashInfer {self.flashinfer_version} JIT cache {self.jit_dir}"
        if self.source == "ahead-of-time":
            return f"{where}: {self.module} is shipped ahead of time, loading {self.aot_library}"
        if self.source == "cache":
            return f"{where}: {self.module} found ({self.library}), loading it"
        return (
            f"{where}: {self.module} not compiled for {'+'.join(self.archs) or '?'}, "
            "compiling it now (about 3 minutes on an H200 host; `moe-sidecar prewarm` "
            "compiles it ahead of time)"
        )


@dataclass(frozen=True)
class ModuleLoad:
    """How the process's all-to-all module became ready."""

    seconds: float
    """Wall time of FlashInfer's ``get_moe_alltoall_module()``: a compile or a load."""
    compiled: bool | None
    """True when the library was written while this process waited for it (a
    compile, by this process or by another one under FlashInfer's build lock);
    False when it was loaded as it was; None when the cache could not be
    inspected."""
    report: JitCacheReport | None
    """What FlashInfer's cache held before the load (None: not inspectable)."""

    def describe(self) -> str:
        """One line for the log."""
        if self.compiled:
            how = "compiled"
        elif self.compiled is False:
            how = "loaded, not compiled"
        else:
            how = "cache not inspected"
        return f"FlashInfer all-to-all module ready in {self.seconds:.2f} s ({how})"


_lock = threading.Lock()
_loaded: ModuleLoad | None = None


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def inspect_jit_cache(module: flashinfer.JitModuleFacts | None = None) -> JitCacheReport:
    """Asks FlashInfer where its all-to-all module would come from, now.

    Imports FlashInfer (its JIT environment and spec) and builds the spec
    object of the all-to-all module (``module``, default: the one of the
    imported FlashInfer's release); compiles and loads nothing.

    Raises:
        ImportError: FlashInfer is not installed.
        Exception: whatever FlashInfer raises when its layout differs from
            the default release's (callers treat the report as unavailable).
    """
    jit_env: Any = importlib.import_module("flashinfer.jit.env")
    jit_core: Any = importlib.import_module("flashinfer.jit.core")
    if module is None:
        # A release not in the table is tried as the default (best effort, as documented).
        release = flashinfer.release_for_version(str(jit_env.flashinfer_version))
        module = (release or flashinfer.DEFAULT_RELEASE).jit_module
    factory_module, factory_name = module.spec_factory.split(":")
    spec = getattr(importlib.import_module(factory_module), factory_name)()
    library = Path(spec.jit_library_path)
    artifacts = tuple(spec.aot_artifacts)
    archs = tuple(
        f"{major}.{minor}"
        for major, minor in sorted(jit_core.current_compilation_context.TARGET_CUDA_ARCHS)
    )
    return JitCacheReport(
        module=str(spec.name),
        flashinfer_version=str(jit_env.flashinfer_version),
        archs=archs,
        cache_dir=Path(jit_env.FLASHINFER_CACHE_DIR),
        jit_dir=Path(jit_env.FLASHINFER_JIT_DIR),
        library=library,
        compiled=library.exists(),
        aot_library=Path(artifacts[0].path) if artifacts else None,
    )


def loaded_module() -> ModuleLoad | None:
    """This process's module load, once :func:`prepare_module` has run."""
    return _loaded


def prepare_module(get_module: Callable[[], object]) -> ModuleLoad:
    """Reports the JIT cache, then loads (or compiles) the module, timed; once per process.

    ``get_module`` is FlashInfer's loader of the all-to-all module
    (``get_moe_alltoall_module``, or ``get_nvlink_one_sided_alltoall_module``;
    cached by FlashInfer: the objects built afterwards reuse what it loaded).
    Later calls return the first call's :class:`ModuleLoad` without calling
    it again.

    Raises:
        Exception: whatever ``get_module`` raises (a failed compile); the
            next call tries again.
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        report: JitCacheReport | None
        try:
            report = inspect_jit_cache()
        except Exception as error:
            report = None
            _log.warning("could not inspect FlashInfer's JIT cache (%s); loading anyway", error)
        else:
            if report.source == "compile":
                _log.warning("%s", report.describe())
            else:
                _log.info("%s", report.describe())
        before = _stamp(report.library) if report is not None else None
        started = time.perf_counter()
        get_module()
        seconds = time.perf_counter() - started
        compiled: bool | None = None
        if report is not None:
            # An ahead-of-time load leaves the cache's library untouched; a
            # failed AOT load falls back to the cache, which may compile.
            compiled = _stamp(report.library) != before
        _loaded = ModuleLoad(seconds=seconds, compiled=compiled, report=report)
        if compiled:
            _log.warning("%s", _loaded.describe())
        else:
            _log.info("%s", _loaded.describe())
        return _loaded
