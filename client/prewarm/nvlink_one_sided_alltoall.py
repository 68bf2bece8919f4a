"""FlashInfer 0.7.4's all-to-all module, ``nvlink_one_sided_alltoall``, and where it keeps it.

FlashInfer 0.7.4 removed ``MoeAlltoAll``; its one-sided all-to-all
(``flashinfer.moe_ep.NVLinkOneSidedAlltoAll``, the one the client's
``flashinfer-moe-ep`` backend builds) is the CUDA module
``nvlink_one_sided_alltoall`` (83 s to compile on an H200 host), compiled
from ``nvlink_one_sided_alltoall.cu`` and ``nvlink_one_sided_lamport.cu``.

0.7.4 lays out the JIT cache as 0.7.2.post1 does (``flashinfer/jit/env.py``,
``cpp_ext.py`` and the compilation context are identical), so this entry's
cache rule is :func:`~moe_sidecar.client.prewarm.mnnvl_moe_alltoall.cache_paths`
with this module's name::

    $FLASHINFER_WORKSPACE_BASE (default $HOME)
      /.cache/flashinfer/0.7.4/<archs>/cached_ops/nvlink_one_sided_alltoall/nvlink_one_sided_alltoall.so

and it reads the same build variables; it adds ``FLASHINFER_JIT_BUILD_LOG``,
a timing log that changes no build command. ``tests/fi074`` checks all of it
against the installed 0.7.4's own JIT spec.
"""

from __future__ import annotations

from moe_sidecar.client.prewarm.cache import JitModule
from moe_sidecar.client.prewarm.mnnvl_moe_alltoall import cache_paths
from moe_sidecar.client.sizing_moe_ep import FLASHINFER_VERSION

__all__ = ["MODULE_NAME", "NVLINK_ONE_SIDED_ALLTOALL"]

MODULE_NAME = "nvlink_one_sided_alltoall"
"""FlashInfer 0.7.4's JIT module behind ``NVLinkOneSidedAlltoAll``."""

NVLINK_ONE_SIDED_ALLTOALL = JitModule(
    flashinfer_version=FLASHINFER_VERSION,
    name=MODULE_NAME,
    role="the all-to-all of the client's flashinfer-moe-ep backend",
    sources=(
        "data/csrc/nvlink_one_sided_alltoall.cu",
        "data/csrc/nvlink_one_sided_lamport.cu",
    ),
    spec_factory="flashinfer.jit.comm:gen_nvlink_one_sided_alltoall_module",
    layout=cache_paths,
)
"""What ``prewarm`` builds for flashinfer-python 0.7.4."""
