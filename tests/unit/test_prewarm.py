"""``moe-sidecar prewarm`` without a GPU and without FlashInfer.

The pure half (architectures, FlashInfer's cache layout, the plan) against
values read from FlashInfer 0.7.2.post1's source and the path the GPU
machine really produced; the environment probes against real executables in
temporary directories; and the command itself, run as a user runs it (the
console script in a subprocess): ``--help``, bad flags, a missing FlashInfer
(the dev environment has none), and, against a stand-in flashinfer-python
distribution (its metadata and the all-to-all's source file, never imported
by the paths tested), the version check, the plan, ``--dry-run`` and the
"already built" second run. The build itself needs FlashInfer, torch with
CUDA and nvcc: ``tests/gpu/test_prewarm.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from moe_sidecar.client.backends.flashinfer import SUPPORTED_FLASHINFER
from moe_sidecar.client.prewarm import (
    DEFAULT_ARCHS,
    JIT_MODULES,
    MODULE_NAME,
    ArchError,
    CudaArch,
    ToolMissing,
    arch_dir_name,
    cache_paths,
    find_build_tools,
    find_cuda_toolkit,
    make_plan,
    normalize_capability,
    parse_arch,
    parse_arch_flags,
    parse_flashinfer_arch_list,
    workspace_base,
)
from moe_sidecar.client.prewarm.command import PREWARM_DEFAULT_ARCHS

pytestmark = pytest.mark.timeout(60)

H = CudaArch(9, "0a")
B = CudaArch(10, "0a")


# --- architectures --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("9.0a", H),
        ("9.0", H),  # FlashInfer gives 9.x the arch-specific suffix
        ("90a", H),
        ("90", H),
        ("sm90a", H),
        ("sm_90a", H),
        ("SM_90A", H),
        ("compute_100a", B),
        ("10.0a", B),
        ("10.0", B),
        ("100a", B),
        ("10.3a", CudaArch(10, "3a")),
        ("103a", CudaArch(10, "3a")),
        ("10.0f", CudaArch(10, "0f")),
        ("100f", CudaArch(10, "0f")),
        ("8.0", CudaArch(8, "0")),  # below 9: no suffix
        ("8.9", CudaArch(8, "9")),
        ("75", CudaArch(7, "5")),
        (" 9.0a ", H),
    ],
)
def test_parse_arch_accepts_the_usual_spellings(text: str, want: CudaArch) -> None:
    assert parse_arch(text) == want


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("7.0", "sm75 or newer"),
        ("70", "sm75 or newer"),
        ("8.0a", "start at 9.0a"),
        ("9.0f", "start at 10.0f"),
        ("hopper", "not a CUDA architecture"),
        ("", "not a CUDA architecture"),
        ("9.10", "not a CUDA architecture"),
        ("9.0b", "not a CUDA architecture"),
        ("12.0", "depends on the CUDA version"),
    ],
)
def test_parse_arch_refuses_what_flashinfer_or_nvcc_would(text: str, why: str) -> None:
    with pytest.raises(ArchError, match=why):
        parse_arch(text)


def test_twelve_follows_flashinfer_s_cuda_version_rule() -> None:
    # CompilationContext._normalize_cuda_arch: 12.0 -> 0f on CUDA 12.9+, 0a on 12.8.
    assert parse_arch("12.0", cuda_version=(13, 0)) == CudaArch(12, "0f")
    assert parse_arch("12.0", cuda_version=(12, 9)) == CudaArch(12, "0f")
    assert parse_arch("12.0", cuda_version=(12, 8)) == CudaArch(12, "0a")
    assert parse_arch("12.1", cuda_version=(12, 9)) == CudaArch(12, "1a")
    assert parse_arch("12.0a") == CudaArch(12, "0a")  # given: kept, no version needed
    with pytest.raises(ArchError, match=r"12\.8"):
        normalize_capability(12, 0, (12, 6))
    with pytest.raises(ArchError, match=r"12\.9"):
        normalize_capability(12, 1, (12, 8))


def test_normalize_capability_is_what_a_gpu_process_targets() -> None:
    # (major, minor) of torch.cuda.get_device_capability -> FlashInfer's target.
    assert normalize_capability(9, 0) == H  # H100, H200
    assert normalize_capability(10, 0) == B  # B200
    assert normalize_capability(10, 3) == CudaArch(10, "3a")  # B300
    assert normalize_capability(8, 0) == CudaArch(8, "0")  # A100
    with pytest.raises(ArchError, match="sm75"):
        normalize_capability(7, 0)


def test_arch_flags_make_one_target_per_item_and_plus_joins() -> None:
    assert parse_arch_flags(["9.0a,10.0a"]) == (frozenset({H}), frozenset({B}))
    assert parse_arch_flags(["9.0a", "10.0a", "90a"]) == (frozenset({H}), frozenset({B}))
    assert parse_arch_flags(["9.0a 10.0a"]) == (frozenset({H}), frozenset({B}))
    assert parse_arch_flags(["9.0a+10.0a"]) == (frozenset({H, B}),)
    assert parse_arch_flags(list(DEFAULT_ARCHS)) == (frozenset({H}), frozenset({B}))
    with pytest.raises(ArchError, match="no architecture"):
        parse_arch_flags([" , "])
    with pytest.raises(ArchError):
        parse_arch_flags(["9.0a,bogus"])


def test_directory_names_sort_as_flashinfer_sorts() -> None:
    # sorted((major: int, minor: str)): 9 before 10, not "100a" before "90a".
    assert arch_dir_name([H]) == "90a"
    assert arch_dir_name([B, H]) == "90a_100a"
    assert arch_dir_name([CudaArch(12, "1a"), CudaArch(12, "0f"), CudaArch(8, "9")]) == (
        "89_120f_121a"
    )
    assert [a.label for a in (H, B)] == ["9.0a", "10.0a"]


def test_flashinfer_arch_list_is_read_as_flashinfer_reads_it() -> None:
    assert parse_flashinfer_arch_list("9.0a 10.0a") == frozenset({H, B})
    assert parse_flashinfer_arch_list("9.0") == frozenset({H})
    assert parse_flashinfer_arch_list("8.9") == frozenset({CudaArch(8, "9")})
    # FlashInfer splits on single spaces and would crash on these at import.
    for bad in ("9.0a,10.0a", "9.0a  10.0a", "90a", ""):
        with pytest.raises(ArchError, match="single spaces"):
            parse_flashinfer_arch_list(bad)


# --- FlashInfer's cache layout ---------------------------------------------------------


def test_cache_path_is_the_one_flashinfer_wrote_on_the_gpu_machine() -> None:
    # bench/results/gpu/prewarm-cold.log: with FLASHINFER_WORKSPACE_BASE=/tmp/fi on the
    # H200 machine, the compiled module landed here.
    paths = cache_paths(Path("/tmp/fi"), SUPPORTED_FLASHINFER, [H])
    assert str(paths.library) == (
        "/tmp/fi/.cache/flashinfer/0.7.2.post1/90a/cached_ops/"
        "mnnvl_moe_alltoall/mnnvl_moe_alltoall.so"
    )
    assert paths.cache_dir == Path("/tmp/fi/.cache/flashinfer")
    assert paths.jit_dir == Path("/tmp/fi/.cache/flashinfer/0.7.2.post1/90a/cached_ops")
    assert paths.lock == paths.jit_dir / "tmp" / f"{MODULE_NAME}.lock"
    both = cache_paths(Path("/b"), "0.7.2.post1", [B, H])
    assert both.workspace_dir == Path("/b/.cache/flashinfer/0.7.2.post1/90a_100a")


def test_workspace_base_is_flashinfers_choice(tmp_path: Path) -> None:
    assert workspace_base({"FLASHINFER_WORKSPACE_BASE": "/var/cache/fi"}, tmp_path) == Path(
        "/var/cache/fi"
    )
    assert workspace_base({}, tmp_path) == tmp_path


def test_plan_skips_what_is_built_or_shipped_ahead_of_time(tmp_path: Path) -> None:
    targets = parse_arch_flags(["9.0a,10.0a"])
    aot = tmp_path / "pkg" / "data" / "aot" / MODULE_NAME / f"{MODULE_NAME}.so"

    def statuses(*, ignore_aot: bool = False, refresh: bool = False) -> list[str]:
        plan = make_plan(
            targets,
            base=tmp_path / "base",
            version=SUPPORTED_FLASHINFER,
            arch_source="--arch",
            aot_library=aot,
            ignore_aot=ignore_aot,
            refresh=refresh,
        )
        assert plan.aot_library == (aot if aot.exists() else None)
        assert plan.cache_dir == tmp_path / "base" / ".cache" / "flashinfer"
        return [t.status for t in plan.targets]

    assert statuses() == ["to-build", "to-build"]
    hopper = cache_paths(tmp_path / "base", SUPPORTED_FLASHINFER, [H]).library
    hopper.parent.mkdir(parents=True)
    hopper.write_bytes(b"\x7fELF")
    assert statuses() == ["already-built", "to-build"]
    assert statuses(refresh=True) == ["to-build", "to-build"]

    aot.parent.mkdir(parents=True)
    aot.write_bytes(b"\x7fELF")
    assert statuses() == ["ahead-of-time", "ahead-of-time"]
    assert statuses(ignore_aot=True) == ["already-built", "to-build"]
    with pytest.raises(ArchError):
        make_plan((), base=tmp_path, version=SUPPORTED_FLASHINFER, arch_source="--arch")


# --- the toolchain -------------------------------------------------------------------


def _executable(path: Path, script: str = "exit 0") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _toolkit(root: Path, release: str = "12.8", *, libs: bool = True) -> Path:
    _executable(
        root / "bin" / "nvcc",
        f'echo "Cuda compilation tools, release {release}, V{release}.93"',
    )
    if libs:
        for lib in ("lib64/libcudart.so", "lib64/stubs/libcuda.so"):
            (root / lib).parent.mkdir(parents=True, exist_ok=True)
            (root / lib).write_bytes(b"")
    return root


def test_toolkit_from_cuda_home_and_its_version(tmp_path: Path) -> None:
    home = _toolkit(tmp_path / "cuda")
    found = find_cuda_toolkit({"CUDA_HOME": str(home), "PATH": ""})
    assert (found.home, found.nvcc, found.version, found.warnings) == (
        home,
        home / "bin" / "nvcc",
        (12, 8),
        (),
    )
    # CUDA_PATH when CUDA_HOME is unset, as FlashInfer's get_cuda_path.
    assert find_cuda_toolkit({"CUDA_PATH": str(home), "PATH": ""}).home == home


def test_toolkit_from_nvcc_on_path_is_two_levels_up(tmp_path: Path) -> None:
    home = _toolkit(tmp_path / "opt" / "cuda-12.8", libs=False)
    found = find_cuda_toolkit({"PATH": str(home / "bin")})
    assert found.home == home
    # FlashInfer links with -L<home>/lib64: say so before a 3-minute compile fails.
    assert any("libcudart.so" in w for w in found.warnings), found.warnings
    assert any("libcuda.so" in w for w in found.warnings), found.warnings


def test_toolkit_missing_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(ToolMissing, match="nvcc not found at"):
        find_cuda_toolkit({"CUDA_HOME": str(tmp_path / "nothing"), "PATH": ""})
    # no CUDA_HOME, no nvcc on PATH, and no /usr/local/cuda
    with pytest.raises(ToolMissing, match="nvcc not found"):
        find_cuda_toolkit({"PATH": str(tmp_path)}, exists=lambda p: False)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_the_machines_own_nvcc_reports_a_version() -> None:
    found = find_cuda_toolkit(os.environ)
    assert found.version is not None and found.version >= (11, 0)


def test_ninja_and_the_compiler(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    _executable(tools / "ninja")
    _executable(tools / "c++")
    assert find_build_tools({"PATH": str(tools)}) == ({}, ())
    # ninja only beside the python (a virtualenv not on PATH): used, with a warning.
    venv_bin = tmp_path / "venv" / "bin"
    _executable(venv_bin / "ninja")
    cxx_only = tmp_path / "cxx"
    _executable(cxx_only / "c++")
    extra, warnings = find_build_tools({"PATH": str(cxx_only)}, python_bin=venv_bin)
    assert extra == {"PATH": f"{venv_bin}{os.pathsep}{cxx_only}"}
    assert "put" in warnings[0] and str(venv_bin) in warnings[0]
    with pytest.raises(ToolMissing, match="ninja"):
        find_build_tools({"PATH": str(cxx_only)}, python_bin=tmp_path / "empty")
    with pytest.raises(ToolMissing, match="C\\+\\+ compiler"):
        find_build_tools({"PATH": str(tools), "CXX": "g++-99"})


# --- the command -----------------------------------------------------------------------


def _moe_sidecar() -> list[str]:
    script = shutil.which("moe-sidecar", path=str(Path(sys.executable).parent))
    assert script is not None, "the moe-sidecar console script is not installed in this venv"
    return [script]


def _prewarm(
    *args: str, env: dict[str, str] | None = None, extra_path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    run_env = dict(os.environ if env is None else env)
    if extra_path is not None:
        run_env["PYTHONPATH"] = str(extra_path)
    return subprocess.run(
        [*_moe_sidecar(), "prewarm", *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=50,
    )


def test_help_lists_prewarm_and_its_flags() -> None:
    top = subprocess.run([*_moe_sidecar(), "--help"], capture_output=True, text=True, timeout=30)
    assert top.returncode == 0 and "prewarm" in top.stdout
    run = _prewarm("--help", env={**os.environ, "COLUMNS": "400"})  # no line wrapping
    assert run.returncode == 0, run.stderr
    for flag in ("--arch", "--workspace-base", "--ignore-aot", "--refresh", "--json"):
        assert flag in run.stdout
    assert "Exit status" in run.stdout and "pip install '.[client,flashinfer]'" in run.stdout
    # The default list in --help (spelled in sidecar/cli.py, which imports no
    # torch) is the one the command uses.
    assert ",".join(DEFAULT_ARCHS) == PREWARM_DEFAULT_ARCHS


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("flashinfer") is not None,
    reason="flashinfer is installed here",
)
def test_without_flashinfer_it_says_which_extra_and_exits_2() -> None:
    run = _prewarm("--arch", "9.0a")
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert "from a moe-sidecar checkout: pip install '.[flashinfer]'" in run.stderr
    as_json = _prewarm("--arch", "9.0a", "--json")
    assert as_json.returncode == 2
    document = json.loads(as_json.stdout)
    assert document["ok"] is False and document["exit_status"] == 2
    assert "flashinfer-python is not installed" in document["error"]


def test_a_bad_arch_is_refused_before_anything_else() -> None:
    run = _prewarm("--arch", "8.0a")
    assert run.returncode == 2
    assert "arch-specific 'a' targets start at 9.0a" in run.stderr and "Traceback" not in run.stderr
    env = {**os.environ, "FLASHINFER_CUDA_ARCH_LIST": "9.0a,10.0a"}
    listed = _prewarm(env=env)
    assert listed.returncode == 2 and "single spaces" in listed.stderr


def _stand_in_flashinfer(root: Path, version: str, *, with_source: bool = True) -> Path:
    """A flashinfer-python distribution as pip lays it out: the package and its
    metadata, and the all-to-all's source files (0.7.4's for 0.7.4, else
    0.7.2.post1's). Nothing in it is executed."""
    package = root / "flashinfer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('a stand-in: never imported')\n")
    if with_source:
        (package / "data" / "csrc").mkdir(parents=True)
        module = JIT_MODULES.get(version, JIT_MODULES[SUPPORTED_FLASHINFER])
        for relative in module.sources:
            (package / relative).parent.mkdir(parents=True, exist_ok=True)
            (package / relative).write_text("// source\n")
    info = root / f"flashinfer_python-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {version}\n"
    )
    return root


def _toolchain_env(tmp_path: Path) -> dict[str, str]:
    """CUDA_HOME and a PATH with ninja and c++: what the plan checks for, no more."""
    home = _toolkit(tmp_path / "cuda", release="13.0")
    tools = tmp_path / "tools"
    _executable(tools / "ninja")
    _executable(tools / "c++")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHINFER_", "CUDA_"))}
    env.update({"CUDA_HOME": str(home), "PATH": f"{tools}{os.pathsep}{env.get('PATH', '')}"})
    return env


def test_another_flashinfer_release_is_refused(tmp_path: Path) -> None:
    site = _stand_in_flashinfer(tmp_path / "site", "0.7.3")
    run = _prewarm("--arch", "9.0a", extra_path=site)
    assert run.returncode == 2, run.stderr
    assert "flashinfer-python 0.7.3 is installed" in run.stderr
    assert f"flashinfer-python=={SUPPORTED_FLASHINFER}" in run.stderr
    assert "flashinfer-python==0.7.4" in run.stderr

    no_source = _stand_in_flashinfer(tmp_path / "site2", SUPPORTED_FLASHINFER, with_source=False)
    run = _prewarm("--arch", "9.0a", extra_path=no_source)
    assert run.returncode == 2 and "trtllm_moe_alltoall.cu" in run.stderr, run.stderr


def test_flashinfer_0_7_4_plans_its_own_module(tmp_path: Path) -> None:
    site = _stand_in_flashinfer(tmp_path / "site", "0.7.4")
    base = tmp_path / "cache-base"
    env = _toolchain_env(tmp_path)
    planned = _prewarm(
        "--arch",
        "9.0a",
        "--workspace-base",
        str(base),
        "--dry-run",
        "--json",
        env=env,
        extra_path=site,
    )
    assert planned.returncode == 0, planned.stderr
    document = json.loads(planned.stdout)
    library = cache_paths(base, "0.7.4", [H], "nvlink_one_sided_alltoall").library
    assert library == (
        base
        / ".cache"
        / "flashinfer"
        / "0.7.4"
        / "90a"
        / "cached_ops"
        / "nvlink_one_sided_alltoall"
        / "nvlink_one_sided_alltoall.so"
    )
    assert [Path(p["library"]) for p in document["planned"]] == [library]
    assert document["flashinfer"] == "0.7.4"

    # Its ahead-of-time copy is looked for under its own name.
    aot = site / "flashinfer" / "data" / "aot" / "nvlink_one_sided_alltoall"
    aot.mkdir(parents=True)
    (aot / "nvlink_one_sided_alltoall.so").write_bytes(b"\x7fELF")
    shipped = _prewarm("--arch", "9.0a", "--workspace-base", str(base), env=env, extra_path=site)
    assert shipped.returncode == 0 and "ships this module ahead of time" in shipped.stdout

    lamport_missing = _stand_in_flashinfer(tmp_path / "site2", "0.7.4")
    (lamport_missing / "flashinfer" / "data" / "csrc" / "nvlink_one_sided_lamport.cu").unlink()
    run = _prewarm("--arch", "9.0a", extra_path=lamport_missing)
    assert run.returncode == 2 and "nvlink_one_sided_lamport.cu" in run.stderr, run.stderr


def test_dry_run_plans_then_a_built_module_is_not_built_again(tmp_path: Path) -> None:
    site = _stand_in_flashinfer(tmp_path / "site", SUPPORTED_FLASHINFER)
    base = tmp_path / "cache-base"
    env = _toolchain_env(tmp_path)
    common = ("--arch", "9.0a,10.0a", "--workspace-base", str(base))

    planned = _prewarm(*common, "--dry-run", "--json", env=env, extra_path=site)
    assert planned.returncode == 0, planned.stderr
    document = json.loads(planned.stdout)
    want = {
        label: cache_paths(base, SUPPORTED_FLASHINFER, [arch]).library
        for label, arch in (("9.0a", H), ("10.0a", B))
    }
    assert document["ok"] is True and document["dry_run"] is True
    assert {p["label"]: Path(p["library"]) for p in document["planned"]} == want
    assert {p["status"] for p in document["planned"]} == {"to-build"}
    assert document["cache_dir"] == str(base / ".cache" / "flashinfer")
    assert document["arch_source"] == "--arch" and document["targets"] == []
    assert "would build into" in planned.stderr
    assert not base.exists(), "a dry run writes nothing"

    # What a finished build leaves: the library. The next run does nothing,
    # whatever the toolchain (none is looked for).
    for library in want.values():
        library.parent.mkdir(parents=True)
        library.write_bytes(b"\x7fELF")
    bare = {**env, "PATH": "/nonexistent", "CUDA_HOME": str(tmp_path / "no-cuda")}
    again = _prewarm(*common, env=bare, extra_path=site)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("already built: ") == 2, again.stdout
    assert "done in" in again.stdout and "2 already built" in again.stdout


def test_an_ahead_of_time_copy_means_nothing_to_build(tmp_path: Path) -> None:
    site = _stand_in_flashinfer(tmp_path / "site", SUPPORTED_FLASHINFER)
    aot = site / "flashinfer" / "data" / "aot" / MODULE_NAME / f"{MODULE_NAME}.so"
    aot.parent.mkdir(parents=True)
    aot.write_bytes(b"\x7fELF")
    env = _toolchain_env(tmp_path)
    base = tmp_path / "cache-base"
    run = _prewarm("--arch", "9.0a", "--workspace-base", str(base), env=env, extra_path=site)
    assert run.returncode == 0, run.stderr
    assert "ships this module ahead of time" in run.stdout and "--ignore-aot" in run.stdout
    ignoring = _prewarm(
        "--arch", "9.0a", "--workspace-base", str(base), "--ignore-aot", "--dry-run",
        env=env, extra_path=site,
    )  # fmt: skip
    assert ignoring.returncode == 0, ignoring.stderr
    assert "would build into" in ignoring.stdout


def test_missing_nvcc_is_reported_when_something_is_to_be_built(tmp_path: Path) -> None:
    site = _stand_in_flashinfer(tmp_path / "site", SUPPORTED_FLASHINFER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHINFER_", "CUDA_"))}
    env.update({"CUDA_HOME": str(tmp_path / "no-cuda"), "PATH": "/usr/bin:/bin"})
    run = _prewarm(
        "--arch", "9.0a", "--workspace-base", str(tmp_path / "b"), "--dry-run",
        env=env, extra_path=site,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "nvcc not found at" in run.stderr and "CUDA_HOME" in run.stderr


# --- the build process -------------------------------------------------------------------


def test_a_failed_build_exits_1_with_flashinfers_error(tmp_path: Path) -> None:
    # The stand-in cannot be imported: the build process fails as it would on
    # a broken FlashInfer install, and its error comes back to the user.
    site = _stand_in_flashinfer(tmp_path / "site", SUPPORTED_FLASHINFER)
    env = _toolchain_env(tmp_path)
    run = _prewarm(
        "--arch", "9.0a", "--workspace-base", str(tmp_path / "b"), "--json",
        env=env, extra_path=site,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "ImportError: a stand-in: never imported" in run.stderr
    document = json.loads(run.stdout)
    assert document["ok"] is False and document["exit_status"] == 1
    [target] = document["targets"]
    assert target["outcome"] == "failed" and "a stand-in" in target["error"]
    assert "building into" in run.stderr and "FAILED" in run.stderr


_SLOW_BUILD = """
import os, subprocess, time
child = subprocess.Popen(["sleep", "120"])  # what nvcc under ninja would be
with open(os.environ["PREWARM_TEST_PIDFILE"], "w") as f:
    f.write(str(child.pid))
time.sleep(120)
"""


def test_a_build_past_its_timeout_is_stopped_with_all_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import time

    import psutil  # type: ignore[import-untyped]

    from moe_sidecar.client.prewarm import BuildFailed, build_target

    site = tmp_path / "site"
    (site / "flashinfer").mkdir(parents=True)
    (site / "flashinfer" / "__init__.py").write_text(_SLOW_BUILD)
    monkeypatch.syspath_prepend(str(site))  # the build process imports what this one would
    pidfile = tmp_path / "nvcc.pid"
    [target] = make_plan(
        [frozenset({H})], base=tmp_path / "b", version=SUPPORTED_FLASHINFER, arch_source="--arch"
    ).targets
    progress = io.StringIO()
    started = time.monotonic()
    # 8 s: the build process (a Python that imports the project) must have
    # started its "compiler" before the timeout, also on a loaded machine.
    with pytest.raises(BuildFailed, match="ran past --timeout 8 s"):
        build_target(
            target,
            env={**os.environ, "PREWARM_TEST_PIDFILE": str(pidfile)},
            timeout=8.0,
            progress=progress,
            progress_every=0.5,
        )
    assert time.monotonic() - started < 30
    lines = progress.getvalue().splitlines()
    assert len(lines) >= 3 and all("9.0a: compiling mnnvl_moe_alltoall ..." in x for x in lines)
    # The process group went with it: the "compiler" is gone too (or a zombie
    # waiting for this container's init to reap it).
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the build's child {pid} outlived the stopped build")


def test_one_table_names_each_release_its_module() -> None:
    # The releases the backends drive, the size tool answers for and prewarm
    # builds are one set (the room's table); each entry's module is the one
    # its backend loads.
    from moe_sidecar import flashinfer
    from moe_sidecar.client.backends import flashinfer as moe_alltoall_backend
    from moe_sidecar.client.backends import flashinfer_moe_ep
    from moe_sidecar.client.size.releases import RELEASES

    assert tuple(JIT_MODULES) == RELEASES == tuple(r.name for r in flashinfer.RELEASES)
    assert JIT_MODULES[moe_alltoall_backend.SUPPORTED_FLASHINFER].name == "mnnvl_moe_alltoall"
    fi074 = JIT_MODULES[flashinfer_moe_ep.SUPPORTED_FLASHINFER]
    assert fi074.name == "nvlink_one_sided_alltoall"
    assert fi074.spec_factory == "flashinfer.jit.comm:gen_nvlink_one_sided_alltoall_module"
    for module in JIT_MODULES.values():
        assert all(s.startswith("data/csrc/") and s.endswith(".cu") for s in module.sources)
