"""What importing SGLang's dispatcher would carry to the GPU machine, compressed.

Run in .venv-sglang: ``.venv-sglang/bin/python bench/gpu_runs/sglang_travel.py``.
Imports SGLang's FlashInfer dispatcher module, its plugin loader, its
ServerArgs and the dispatcher factory, then compresses (zlib, level 9) every
loaded file under site-packages, per top-level package, and sums what the GPU
machine lacks: everything but torch and the packages torch brings there.
"""

from __future__ import annotations

import collections
import importlib
import os
import sys
import zlib

MODULES = (
    "sglang.srt.layers.moe.token_dispatcher.flashinfer",
    "sglang.srt.plugins",
    "sglang.srt.server_args",
    "sglang.srt.layers.moe.fused_moe_triton.layer",
)
ON_THE_GPU_MACHINE = {"torch", "sympy", "networkx", "mpmath", "jinja2", "markupsafe", "filelock",
                      "fsspec", "typing_extensions.py", "setuptools", "pkg_resources", "_pytest",
                      "pytest", "pluggy"}  # fmt: skip


def main() -> int:
    for name in MODULES:
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
    print(f"lacking on the GPU machine: {sum(lacking.values()) / 1e6:.1f} MB compressed")
    without = sum(size for top, size in lacking.items() if top != "triton")
    print(f"of which not triton: {without / 1e6:.1f} MB compressed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
