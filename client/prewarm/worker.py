"""The build process: FlashInfer's own JIT spec of the module, built under FlashInfer's lock.

Started by :func:`moe_sidecar.client.prewarm.builder.build_target` with
``FLASHINFER_CUDA_ARCH_LIST`` and ``FLASHINFER_WORKSPACE_BASE`` set to the
target's and ``CUDA_VISIBLE_DEVICES=``. It calls the spec's ``build()``
under FlashInfer's own lock file (``<cached_ops>/tmp/<module>.lock``), so a
concurrent inference process and ``prewarm`` never compile at once; it never
loads the module, which needs a GPU driver.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _file_stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_mtime_ns, st.st_size)


def _build(request: Mapping[str, Any], result: dict[str, Any]) -> None:
    """Builds the module ``request`` names, filling ``result`` as it goes.

    Raises:
        RuntimeError: this flashinfer is not the one planned for, lays out
            its cache otherwise, or its build wrote no library.
        Exception: whatever FlashInfer's build raises (a failed compile).
    """
    jit_env = importlib.import_module("flashinfer.jit.env")
    factory_module, factory_name = str(request["spec_factory"]).split(":")
    factory = getattr(importlib.import_module(factory_module), factory_name)
    filelock = importlib.import_module("filelock")
    if "package_dir" in request:
        imported = Path(str(importlib.import_module("flashinfer").__file__)).resolve().parent
        if imported != Path(request["package_dir"]):
            raise RuntimeError(
                f"the build process imports flashinfer from {imported}, not from "
                f"{request['package_dir']}"
            )
    spec = factory()
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


def main(argv: Sequence[str] | None = None) -> None:
    """The build process's entry: argv[0] is a JSON request.

    The request is ``{"result": path, "library": expected path, "verbose":
    bool, "spec_factory": "module:function", "package_dir": path (optional)}``.
    Writes a JSON result to ``result`` and exits 0 (built or up to date) or 1
    (the result's ``error`` says why), whatever went wrong.
    """
    request = json.loads((sys.argv[1:] if argv is None else argv)[0])
    result: dict[str, Any] = {}
    code = 1
    try:
        _build(request, result)
        code = 0
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
    Path(request["result"]).write_text(json.dumps(result))
    sys.exit(code)
