"""FlashInfer 0.7.2.post1's all-to-all module, ``mnnvl_moe_alltoall``, and where it keeps it.

The first use of FlashInfer's ``MoeAlltoAll`` in a machine JIT-compiles the
CUDA module ``mnnvl_moe_alltoall`` (about 190 s on an H200 host) into
FlashInfer's cache. It is the one the client's ``flashinfer`` backend loads
(``MoeAlltoAll(backend="trtllm")``, which is also what ``flashinfer.moe_ep``'s
``NVLinkOneSidedAlltoAll`` builds on).

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
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from moe_sidecar.client.prewarm.archs import CudaArch, arch_dir_name
from moe_sidecar.client.prewarm.cache import CachePaths, JitModule, flashinfer_cache_dir

__all__ = ["MNNVL_MOE_ALLTOALL", "MODULE_NAME", "cache_paths"]

MODULE_NAME = "mnnvl_moe_alltoall"
"""FlashInfer's JIT module behind ``MoeAlltoAll(backend="trtllm")`` (its default)."""


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


MNNVL_MOE_ALLTOALL = JitModule(
    # The backend that drives this release takes its release from here
    # (client.backends.flashinfer.SUPPORTED_FLASHINFER).
    flashinfer_version="0.7.2.post1",
    name=MODULE_NAME,
    role="the all-to-all of the client's flashinfer backend",
    sources=("data/csrc/trtllm_moe_alltoall.cu",),
    spec_factory="flashinfer.jit.comm:gen_moe_alltoall_module",
    layout=cache_paths,
)
"""What ``prewarm`` builds for flashinfer-python 0.7.2.post1."""
