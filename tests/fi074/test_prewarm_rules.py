"""``moe-sidecar prewarm``'s cache rules, checked against FlashInfer 0.7.4's own JIT code.

In a child process with ``FLASHINFER_WORKSPACE_BASE`` and
``FLASHINFER_CUDA_ARCH_LIST`` set, FlashInfer 0.7.4's JIT spec of the
one-sided all-to-all (built, never compiled) names the module, library and
lock file prewarm computes, compiles the sources prewarm checks for, and the
backend's cache report reads the same. The build variables 0.7.4's JIT
reads are those prewarm knows: a new one fails here.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_sidecar.client.prewarm import (
    BUILD_ENV,
    ENV_ARCH_LIST,
    ENV_WORKSPACE_BASE,
    JIT_MODULES,
    find_flashinfer,
    parse_arch,
)

pytestmark = [pytest.mark.fi074, pytest.mark.timeout(120)]

MODULE = JIT_MODULES["0.7.4"]

_SPEC = """
import json, sys
import importlib
from moe_sidecar.client.backends.jit_cache import inspect_jit_cache
factory_module, factory_name = sys.argv[1].split(":")
spec = getattr(importlib.import_module(factory_module), factory_name)()
report = inspect_jit_cache()
print(json.dumps({
    "name": spec.name,
    "library": str(spec.jit_library_path),
    "lock": str(spec.lock_path),
    "sources": [str(s) for s in spec.sources],
    "aot": [str(a.path) for a in spec.aot_artifacts],
    "report": [report.module, report.flashinfer_version, str(report.library), report.source],
}))
"""


def test_the_spec_lands_where_prewarm_builds(tmp_path: Path) -> None:
    install = find_flashinfer()
    assert install.version == "0.7.4" and install.jit_module == MODULE
    env = {ENV_WORKSPACE_BASE: str(tmp_path), ENV_ARCH_LIST: "9.0a", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", _SPEC, MODULE.spec_factory],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    spec = json.loads(done.stdout.splitlines()[-1])
    paths = MODULE.paths(tmp_path, "0.7.4", [parse_arch("9.0a")])
    assert spec["name"] == MODULE.name
    assert Path(spec["library"]) == paths.library
    assert Path(spec["lock"]) == paths.lock
    assert {str(install.package_dir / s) for s in MODULE.sources} <= set(spec["sources"])
    assert spec["aot"] in ([], [str(install.aot_library())])
    assert spec["report"] == [MODULE.name, "0.7.4", str(paths.library), "compile"]


def test_the_variables_its_jit_reads_are_those_prewarm_knows() -> None:
    found = importlib.util.find_spec("flashinfer")
    assert found is not None and found.submodule_search_locations
    package = Path(next(iter(found.submodule_search_locations)))
    read = re.compile(
        r"""(?:os\.environ\.get|os\.getenv|parse_env_flags)\(\s*["']([A-Z_][A-Z0-9_]*)["']"""
        r"""|os\.environ\[\s*["']([A-Z_][A-Z0-9_]*)["']\s*\]"""
        r"""|env_var_name\s*=\s*["']([A-Z_][A-Z0-9_]*)["']"""
        r"""|["']([A-Z_][A-Z0-9_]*)["']\s+in\s+os\.environ"""
    )
    names = set()
    # What decides where the module goes and how it is compiled.
    for part in ("jit/env.py", "jit/cpp_ext.py", "jit/core.py", "compilation_context.py"):
        for match in read.finditer((package / part).read_text()):
            names.add(next(g for g in match.groups() if g))
    handled = {ENV_WORKSPACE_BASE, ENV_ARCH_LIST, "FLASHINFER_DISABLE_JIT"}
    # Read, but they change no command of build.ninja: cubin downloads, the
    # version check, logging, 0.7.4's build-time log, how many jobs build.
    not_build = {
        "FLASHINFER_CUBIN_DIR",
        "FLASHINFER_DISABLE_VERSION_CHECK",
        "FLASHINFER_LOGGING_LEVEL",
        "FLASHINFER_JIT_BUILD_LOG",
        "FLASHINFER_JIT_PREBUILD_MAX_JOBS",
        "MAX_JOBS",
    }
    assert names == set(BUILD_ENV) | handled | not_build
