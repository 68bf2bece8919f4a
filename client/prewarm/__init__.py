"""``moe-sidecar prewarm``: FlashInfer's all-to-all module compiled into its JIT cache ahead of time.

The implementation loads on first use of a name below, so that
``moe-sidecar prewarm --help`` and the sidecar's own commands import no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_sidecar.client.prewarm.build import (
        BUILD_ENV,
        DEFAULT_ARCHS,
        ENV_ARCH_LIST,
        ENV_WORKSPACE_BASE,
        FLASHINFER_DISTRIBUTION,
        MODULE_NAME,
        ArchError,
        BuildFailed,
        CachePaths,
        CudaArch,
        CudaToolkit,
        FlashInferInstall,
        FlashInferMissing,
        FlashInferVersionMismatch,
        Plan,
        PrewarmError,
        Target,
        TargetResult,
        ToolMissing,
        arch_dir_name,
        build_target,
        cache_paths,
        find_build_tools,
        find_cuda_toolkit,
        find_flashinfer,
        flashinfer_cache_dir,
        make_plan,
        normalize_capability,
        parse_arch,
        parse_arch_flags,
        parse_flashinfer_arch_list,
        run_cli,
        visible_gpu_archs,
        workspace_base,
    )

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

_IMPLEMENTATION = "moe_sidecar.client.prewarm.build"


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(_IMPLEMENTATION), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
