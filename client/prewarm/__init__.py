"""``moe-sidecar prewarm``: FlashInfer's all-to-all module compiled into its JIT cache ahead of time.

``prewarm`` builds exactly the module an inference rank will load, with
FlashInfer's own build code, into the very directory an inference process
will look in, on a machine with nvcc and no GPU (an image build, an init
container). One module per job:

- :mod:`.archs`: CUDA architectures as FlashInfer spells and normalises them;
- :mod:`.cache`: the cache's paths (:func:`cache_paths`), what makes a build
  found again, and :class:`JitModule`, one FlashInfer release's module (from
  :data:`moe_sidecar.flashinfer.RELEASES`) with its cache rule;
- :mod:`.install`: the installed flashinfer-python and its entry
  (:data:`JIT_MODULES`);
- :mod:`.toolchain`: nvcc, ninja and the C++ compiler;
- :mod:`.build_plan`: what is built and why (pure);
- :mod:`.builder` and :mod:`.worker`: one build in a child process that
  imports FlashInfer, with a timeout;
- :mod:`.run`: the command's run and its report; :mod:`.command` its flags.

The names below load their module on first use, so that
``moe-sidecar prewarm --help`` and the sidecar's own commands import no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_sidecar.client.lazy_names import lazy_names

if TYPE_CHECKING:
    from moe_sidecar.client.prewarm.archs import (
        DEFAULT_ARCHS,
        ENV_ARCH_LIST,
        CudaArch,
        arch_dir_name,
        normalize_capability,
        parse_arch,
        parse_arch_flags,
        parse_flashinfer_arch_list,
        visible_gpu_archs,
    )
    from moe_sidecar.client.prewarm.build_plan import BuildPlan, Target, make_plan
    from moe_sidecar.client.prewarm.builder import TargetResult, build_target
    from moe_sidecar.client.prewarm.cache import (
        BUILD_ENV,
        ENV_WORKSPACE_BASE,
        MODULE_NAME,
        CachePaths,
        JitModule,
        cache_paths,
        flashinfer_cache_dir,
        jit_module_of,
        workspace_base,
    )
    from moe_sidecar.client.prewarm.errors import (
        ArchError,
        BuildFailed,
        FlashInferMissing,
        FlashInferVersionMismatch,
        PrewarmError,
        ToolMissing,
    )
    from moe_sidecar.client.prewarm.install import (
        DEFAULT_JIT_MODULE,
        FLASHINFER_DISTRIBUTION,
        JIT_MODULES,
        FlashInferInstall,
        find_flashinfer,
    )
    from moe_sidecar.client.prewarm.run import run_cli
    from moe_sidecar.client.prewarm.toolchain import (
        CudaToolkit,
        find_build_tools,
        find_cuda_toolkit,
    )

__all__ = [
    "BUILD_ENV",
    "DEFAULT_ARCHS",
    "DEFAULT_JIT_MODULE",
    "ENV_ARCH_LIST",
    "ENV_WORKSPACE_BASE",
    "FLASHINFER_DISTRIBUTION",
    "JIT_MODULES",
    "MODULE_NAME",
    "ArchError",
    "BuildFailed",
    "BuildPlan",
    "CachePaths",
    "CudaArch",
    "CudaToolkit",
    "FlashInferInstall",
    "FlashInferMissing",
    "FlashInferVersionMismatch",
    "JitModule",
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
    "jit_module_of",
    "make_plan",
    "normalize_capability",
    "parse_arch",
    "parse_arch_flags",
    "parse_flashinfer_arch_list",
    "run_cli",
    "visible_gpu_archs",
    "workspace_base",
]

__getattr__ = lazy_names(
    __name__,
    {
        "archs": (
            "DEFAULT_ARCHS",
            "ENV_ARCH_LIST",
            "CudaArch",
            "arch_dir_name",
            "normalize_capability",
            "parse_arch",
            "parse_arch_flags",
            "parse_flashinfer_arch_list",
            "visible_gpu_archs",
        ),
        "build_plan": ("BuildPlan", "Target", "make_plan"),
        "builder": ("TargetResult", "build_target"),
        "cache": (
            "BUILD_ENV",
            "ENV_WORKSPACE_BASE",
            "MODULE_NAME",
            "CachePaths",
            "JitModule",
            "cache_paths",
            "flashinfer_cache_dir",
            "jit_module_of",
            "workspace_base",
        ),
        "errors": (
            "ArchError",
            "BuildFailed",
            "FlashInferMissing",
            "FlashInferVersionMismatch",
            "PrewarmError",
            "ToolMissing",
        ),
        "install": (
            "DEFAULT_JIT_MODULE",
            "FLASHINFER_DISTRIBUTION",
            "JIT_MODULES",
            "FlashInferInstall",
            "find_flashinfer",
        ),
        "run": ("run_cli",),
        "toolchain": ("CudaToolkit", "find_build_tools", "find_cuda_toolkit"),
    },
)
