"""What importing an engine's modules would carry to the GPU machine, compressed.

Run in the engine's environment, from the repository root:

    .venv-sglang/bin/python bench/gpu_runs/import_travel.py sglang
    .venv/bin/python bench/gpu_runs/import_travel.py vllm

Imports the modules the engine's tests and our adapter load (SGLang: its
FlashInfer dispatcher, plugin loader, ServerArgs and dispatcher factory;
vLLM 0.33: its fault-tolerance sentinel and request, the all-to-all manager
module, the NVLink one-sided prepare/finalize, its config, parallel state
and plugin loader), then compresses (zlib, level 9) every loaded file under
site-packages, per top-level package, and sums what the GPU machine lacks:
everything but torch and the packages torch brings there. It ends with the
room a call has for it: the 64 MiB a call carries, less this checkout's
travelling files and ``.gpu/wheels``. The sizes are this environment's
(Python 3.11 here; the GPU machine's 3.12 needs its own binary wheels, of
about the same size).
"""

from __future__ import annotations

import collections
import importlib
import os
import subprocess
import sys
import zlib
from pathlib import Path

ENGINES: dict[str, tuple[tuple[str, ...], str]] = {
    # engine: (the modules to import, the package reported apart)
    "sglang": (
        (
            "sglang.srt.layers.moe.token_dispatcher.flashinfer",
            "sglang.srt.plugins",
            "sglang.srt.server_args",
            "sglang.srt.layers.moe.fused_moe_triton.layer",
        ),
        "triton",  # SGLang imports triton at import time
    ),
    "vllm": (
        (
            "vllm.v1.worker.sentinel.gpu_worker_sentinel",
            "vllm.v1.fault_tolerance.utils",
            "vllm.model_executor.layers.fused_moe.all2all_utils",
            "vllm.model_executor.layers.fused_moe.prepare_finalize.flashinfer_nvlink_one_sided",
            "vllm.distributed.device_communicators.all2all",
            "vllm.distributed.parallel_state",
            "vllm.config",
            "vllm.plugins",
        ),
        "vllm",  # its own Python files
    ),
}
ON_THE_GPU_MACHINE = {"torch", "sympy", "networkx", "mpmath", "jinja2", "markupsafe", "filelock",
                      "fsspec", "typing_extensions.py", "setuptools", "pkg_resources", "_pytest",
                      "pytest", "pluggy"}  # fmt: skip
CALL_LIMIT_BYTES = 64 * 2**20  # what one device call carries: the working tree plus carried folders


def _travelling_bytes(root: Path) -> tuple[int, int]:
    """The checkout's travelling files (tracked, and untracked but not ignored), and .gpu/wheels."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    paths = (root / os.fsdecode(name) for name in listed if name)
    # A file deleted but not yet staged is still listed: it does not travel.
    tree = sum(path.stat().st_size for path in paths if path.is_file())
    wheels = sum(path.stat().st_size for path in (root / ".gpu" / "wheels").glob("*.whl"))
    return tree, wheels


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ENGINES:
        print(f"usage: import_travel.py {'|'.join(ENGINES)}", file=sys.stderr)
        return 2
    modules, apart = ENGINES[argv[0]]
    for name in modules:
        importlib.import_module(name)
    site = next(p for p in sys.path if p.endswith("site-packages"))
    packed: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not path.startswith(site):
            continue
        top = os.path.relpath(path, site).split(os.sep)[0]
        with open(path, "rb") as handle:
            packed[top] += len(zlib.compress(handle.read(), 9))
        files[top] += 1
    for top, size in packed.most_common(12):
        print(f"{top:24} {files[top]:5} files {size / 1e6:7.2f} MB compressed")
    lacking = {top: size for top, size in packed.items() if top not in ON_THE_GPU_MACHINE}
    total = sum(lacking.values())
    print(f"lacking on the GPU machine: {total / 1e6:.1f} MB compressed")
    own = lacking.get(apart, 0)
    print(f"of which {apart}: {own / 1e6:.1f} MB, the rest {(total - own) / 1e6:.1f} MB")
    tree, wheels = _travelling_bytes(Path(__file__).resolve().parents[2])
    room = CALL_LIMIT_BYTES - tree - wheels
    print(
        f"room in one call: {CALL_LIMIT_BYTES / 1e6:.1f} MB less the checkout {tree / 1e6:.1f} MB"
        f" and .gpu/wheels {wheels / 1e6:.1f} MB = {room / 1e6:.1f} MB: {'fits' if total <= room else 'does not fit'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
