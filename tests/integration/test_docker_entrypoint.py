"""The sidecar image, checked without a Docker engine.

The build machines have the Docker CLI but no engine, so ``docker build`` and
``docker run`` cannot run here. Instead these tests read ``docker/Dockerfile``
and do what the image does, outside a container:

* the build stage's steps, for real: the build context filtered by
  ``.dockerignore``, the ``COPY`` steps into a temporary root, and the ``RUN``
  steps (a fresh virtualenv, ``pip install .`` from PyPI) with the image's
  absolute paths moved under that root;
* the final stage's ``ENTRYPOINT`` under exactly the image's ``ENV``, from
  that virtualenv, with only the host ports and the TCP port changed (tests
  never take fixed ports): it must serve health, a Propose round on the Unix
  socket and on TCP, and metrics, and drain on SIGTERM;
* the shape of the image: slim Python stages, a numeric non-root user, the
  ports and volumes that ``SidecarConfig``'s defaults and the image's
  environment name, no torch, CUDA or flashinfer anywhere.

``docker/Dockerfile.inference`` (the example inference stage that runs
``moe-sidecar prewarm`` at build time) is checked by reading it: a CUDA devel
base, the client and flashinfer extras from the same build context, and a
prewarm command that the real CLI parses, run as the image's user after the
install, into the ``FLASHINFER_WORKSPACE_BASE`` the image keeps for its
processes, with no variable that would send them to another cache directory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar import cli
from moe_sidecar.config import SidecarConfig, config_from_flags
from moe_sidecar.servicer import SERVICE_NAME
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.dockerfile import (
    REPO,
    Stage,
    dockerignore_rules,
    in_build_context,
    parse_dockerfile,
)
from tests.integration.helpers import wait_for_serving_record

STAGES = parse_dockerfile()
FINAL = STAGES[-1]
# The python images' own ENV PATH, under the image's ENV instructions.
BASE_IMAGE_ENV = {"PATH": "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"}
FORBIDDEN = re.compile(r"torch|flashinfer|cuda|nvidia", re.IGNORECASE)


def image_env() -> dict[str, str]:
    # Each FROM starts over from its base image: only the final stage's ENV counts.
    return FINAL.env(BASE_IMAGE_ENV)


def image_command() -> list[str]:
    entrypoint = FINAL.all("ENTRYPOINT")[-1].exec_form()
    cmd = FINAL.all("CMD")[-1].exec_form() if FINAL.all("CMD") else []
    return [*entrypoint, *cmd]


def image_config(env: dict[str, str] | None = None) -> SidecarConfig:
    """What ``moe-sidecar serve`` makes of the image's command and environment."""
    command = image_command()
    assert command[0] == "moe-sidecar"
    args = cli.build_parser().parse_args(command[1:])
    return config_from_flags(args, image_env() if env is None else env)


def _image_user() -> tuple[int, int]:
    user = FINAL.all("USER")[-1].arguments
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit(), (
        f"USER {user}: numeric uid:gid, so runAsNonRoot can verify it"
    )
    return int(uid), int(gid)


# --- the shape of the image ----------------------------------------------------------


def test_image_is_multi_stage_on_slim_python_and_installs_only_the_sidecar() -> None:
    assert len(STAGES) >= 2, "a build stage and a runtime stage"
    for stage in STAGES:
        assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", stage.base), stage.base
    build = STAGES[0]
    copies = [shlex.split(c.arguments) for c in FINAL.all("COPY")]
    assert [c for c in copies if c[0] == f"--from={build.name}"], "the runtime copies the build"
    installs = [
        shlex.split(r.arguments)
        for s in STAGES
        for r in s.all("RUN")
        if "pip install" in r.arguments
    ]
    assert installs, "the build stage pip-installs the project"
    for words in installs:
        targets = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
        # The project itself, without extras: not '.[client]', no extra package.
        assert targets == ["."], words
    for stage in STAGES:
        for instruction in stage.instructions:
            assert not FORBIDDEN.search(instruction.arguments), instruction


def test_image_serves_as_a_non_root_user_configured_by_environment() -> None:
    assert image_command() == ["moe-sidecar", "serve"]
    uid, gid = _image_user()
    assert uid != 0 and gid != 0
    defaults = SidecarConfig()
    config = image_config()  # raises on an unknown or malformed MOE_SIDECAR_* value
    assert config.health_port == defaults.health_port
    assert config.metrics_port == defaults.metrics_port
    assert config.state_dir == defaults.state_dir
    exposed = {int(p.split("/")[0]) for e in FINAL.all("EXPOSE") for p in e.arguments.split()}
    assert exposed == {config.health_port, config.metrics_port}
    volumes = {v for i in FINAL.all("VOLUME") for v in i.exec_form()}
    unix = [a for a in config.listen_addresses if a.unix_path is not None]
    tcp = [a for a in config.listen_addresses if a.unix_path is None]
    assert len(unix) == 1 and unix[0].unix_path is not None
    # Only loopback TCP: the coordinator is for the pod, health/metrics for the cluster.
    assert [a.host for a in tcp] == ["127.0.0.1"]
    socket_dir = str(unix[0].unix_path.parent)
    assert volumes == {str(config.state_dir), socket_dir}
    # The runtime stage creates both, owned by the image's user (a fresh
    # volume copies that ownership; the user could not create them itself).
    created = " ".join(r.arguments for r in FINAL.all("RUN"))
    for directory in volumes:
        assert re.search(
            rf"install -d -o {uid} -g {gid} -m 07[57]0 {re.escape(directory)}\b", created
        )
    # Logs for machines, by default.
    assert config.log_format == "json"


def _tracked_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True, timeout=30
    )
    return listed.stdout.splitlines()


def _copy_sources(stage: Stage) -> list[str]:
    sources = []
    for instruction in stage.all("COPY"):
        words = shlex.split(instruction.arguments)
        if not words[0].startswith("--from="):
            sources += [w.rstrip("/") for w in words[:-1]]
    return sources


def test_build_context_holds_what_the_build_copies_and_nothing_else() -> None:
    rules = dockerignore_rules()
    sources = _copy_sources(STAGES[0])
    assert set(sources) == {"pyproject.toml", "README.md", "proto", "sidecar", "client"}
    tracked = _tracked_files()
    for source in sources:
        below = [f for f in tracked if f == source or f.startswith(source + "/")]
        assert below, f"COPY {source}: nothing tracked there"
        for path in below:
            assert in_build_context(path, rules), f"{path} is copied but .dockerignore drops it"
    for path in tracked:
        top = path.split("/")[0]
        if top not in sources:
            assert not in_build_context(path, rules), f"{path} reaches the build context"
    for path in (
        ".venv/bin/python",
        ".git/config",
        "state/sidecar.sqlite3",
        "sidecar/__pycache__/cli.cpython-311.pyc",
    ):
        assert not in_build_context(path, rules), path


# --- the sidecar's dependencies --------------------------------------------------------


def test_sidecar_depends_on_and_imports_neither_torch_nor_flashinfer() -> None:
    probe = (
        "import importlib.metadata, json, sys\n"
        "import moe_sidecar, moe_sidecar.cli, moe_sidecar.server, moe_sidecar.__main__\n"
        "moe_sidecar.cli.build_parser()\n"
        "print(json.dumps({'modules': sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('torch', 'flashinfer') or m.startswith('moe_sidecar.client')),"
        " 'requires': importlib.metadata.requires('moe-sidecar')}))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert found.returncode == 0, found.stderr
    result = json.loads(found.stdout)
    # Building the parser loads the tools' command modules (flags only, through
    # the moe_sidecar.commands entry points) and nothing else of the client
    # (size's flags take their choices from size.releases, two constants; the
    # packages' faces defer their names through lazy_names, importlib alone).
    commands = {"simulate", "prewarm", "size"}
    light = {
        "moe_sidecar.client",
        "moe_sidecar.client.lazy_names",
        "moe_sidecar.client.size.releases",
    } | {f"moe_sidecar.client.{tool}{suffix}" for tool in commands for suffix in ("", ".command")}
    assert set(result["modules"]) <= light, "importing the sidecar pulled these in"
    core = [r for r in result["requires"] if "extra ==" not in r]
    extras = [r for r in result["requires"] if "extra ==" in r]
    assert core and not [r for r in core if FORBIDDEN.search(r)], core
    # The markers are read right: torch and flashinfer are there, as extras.
    assert any(r.startswith("torch") and 'extra == "client"' in r for r in extras), extras
    assert any(r.startswith("flashinfer") for r in extras), extras


# --- the build stage and the entrypoint, for real ---------------------------------------


# A '/' that starts a word, a PATH element, an env value or a unix:// address.
_ABSOLUTE = re.compile(r"(?:^|(?<=[\s=:,])|(?<=unix://))/(?=\w)")


def _under(root: Path, text: str) -> str:
    """``text`` with every absolute path (a word starting with '/') moved under ``root``."""
    return _ABSOLUTE.sub(f"{root}/", text)


def _copy_into(source: Path, destination: Path, rules: list[tuple[bool, re.Pattern[str]]]) -> None:
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    for path in files:
        relative = path.relative_to(REPO).as_posix()
        if not in_build_context(relative, rules):
            continue
        target = destination / (path.name if source.is_file() else path.relative_to(source))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def _host_env() -> dict[str, str]:
    """What pip needs from the host: a home for its cache, proxies, index settings."""
    keep = {
        "HOME",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
    }
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("PIP_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    return env


def build_stage_into(root: Path, stage: Stage) -> None:
    """Runs ``stage``'s WORKDIR, COPY and RUN steps with ``/`` moved to ``root``."""
    rules = dockerignore_rules()
    workdir = Path("/")
    env = {**_host_env(), **{k: v for k, v in stage.env({}).items() if k != "PATH"}}
    for instruction in stage.instructions:
        if instruction.keyword == "WORKDIR":
            workdir = workdir / instruction.arguments
            Path(_under(root, str(workdir))).mkdir(parents=True, exist_ok=True)
        elif instruction.keyword == "COPY":
            *sources, destination = shlex.split(instruction.arguments)
            target = Path(_under(root, str(workdir / destination)))
            for source in sources:
                _copy_into(REPO / source.rstrip("/"), target, rules)
        elif instruction.keyword == "RUN":
            done = subprocess.run(
                ["/bin/sh", "-c", _under(root, instruction.arguments)],
                cwd=_under(root, str(workdir)),
                env=env,
                capture_output=True,
                text=True,
                timeout=400,
            )
            assert done.returncode == 0, (
                f"RUN {instruction.arguments}\n{done.stdout}\n{done.stderr}"
            )
        elif instruction.keyword != "ENV":
            raise AssertionError(f"the build stage has {instruction.keyword}; teach this test it")


@pytest.fixture
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A short root: the image's socket path must stay under Linux's 107 bytes.
    return tmp_path_factory.mktemp("img")


def _propose_one_rank(target: str, group: str) -> int:
    with grpc.insecure_channel(target) as channel:
        answer = pb_grpc.WorkspaceCoordinatorStub(channel).Propose(
            pb.ProposeRequest(
                group=group,
                ep_size=1,
                ep_rank=0,
                local_ranks=1,
                lifetime="image-test-lifetime-token",
                round=1,
                requirement=pb.Requirement(
                    capacities=pb.Capacities(
                        max_tokens=8,
                        dispatch_bytes_per_token=64,
                        combine_bytes_per_token=128,
                        top_k=2,
                        num_experts=4,
                    ),
                    layer="l0",
                ),
            ),
            timeout=10,
        )
    return int(answer.action)


def _health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(reply.status)


@pytest.mark.timeout(600)
def test_image_build_steps_install_a_sidecar_that_serves_under_the_image_env(
    image_root: Path,
) -> None:
    build, *_, runtime = STAGES
    build_stage_into(image_root, build)
    for words in (shlex.split(c.arguments) for c in runtime.all("COPY")):
        # COPY --from=build X X: the same path in both stages, so the venv built
        # under the root is the runtime's as it stands.
        assert words[0] == f"--from={build.name}" and words[1] == words[2], words

    # Only the sidecar's distributions are installed: no torch, CUDA or flashinfer.
    venv_python = Path(_under(image_root, "/opt/moe-sidecar/bin/python"))
    listing = subprocess.run(
        [
            str(venv_python),
            "-c",
            "import importlib.metadata as m, json; "
            "print(json.dumps(sorted(d.metadata['Name'].lower() for d in m.distributions())))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={},
    )
    assert listing.returncode == 0, listing.stderr
    installed = json.loads(listing.stdout)
    assert "moe-sidecar" in installed and "grpcio" in installed
    assert not [d for d in installed if FORBIDDEN.search(d)], installed
    # The demo needs the client extra; without torch it says so, no traceback.
    demo = subprocess.run(
        [str(venv_python.parent / "moe-sidecar"), "simulate"],
        capture_output=True,
        text=True,
        timeout=60,
        env={},
    )
    assert demo.returncode == 2 and "Traceback" not in demo.stderr, demo.stderr
    assert "needs torch, i.e. the client extra: from a checkout, python -m pip" in demo.stderr
    assert "pip install '.[client]'" in demo.stderr
    prewarm = subprocess.run(
        [str(venv_python.parent / "moe-sidecar"), "prewarm"],
        capture_output=True,
        text=True,
        timeout=60,
        env={},
    )
    assert prewarm.returncode == 2 and "Traceback" not in prewarm.stderr, prewarm.stderr
    assert "from a checkout, pip install '.[client,flashinfer]'" in prewarm.stderr

    # The image's environment, paths under the root; only ports change.
    env = {k: _under(image_root, v) for k, v in image_env().items()}
    image_ports = {env["MOE_SIDECAR_HEALTH_PORT"], env["MOE_SIDECAR_METRICS_PORT"]}
    # "auto": the OS picks free ports and the serving line names them.
    overrides = {
        "MOE_SIDECAR_HEALTH_PORT": "auto",
        "MOE_SIDECAR_METRICS_PORT": "auto",
        "MOE_SIDECAR_LISTEN": ",".join(
            a if a.startswith("unix:") else f"{a.rpartition(':')[0]}:0"
            for a in env["MOE_SIDECAR_LISTEN"].split(",")
        ),
    }
    assert set(overrides) <= set(env), "the test may change the image's values, not add any"
    env.update(overrides)
    config = image_config(env)
    socket_path = next(a.unix_path for a in config.listen_addresses if a.unix_path is not None)
    assert socket_path is not None and socket_path.is_relative_to(image_root)
    command = image_command()
    executable = shutil.which(command[0], path=env["PATH"])
    assert executable is not None and Path(executable).is_relative_to(image_root), executable

    log = image_root / "entrypoint.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [executable, *command[1:]],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=image_root,
        )
    try:
        serving = wait_for_serving_record(process, log, timeout=60)
        unix_target, tcp_target = serving["listen"]
        assert unix_target == f"unix://{socket_path}"
        health_port, metrics_port = serving["health_port"], serving["metrics_port"]
        # The overrides were obeyed: not the image's ports.
        assert not {str(health_port), str(metrics_port)} & image_ports, serving
        assert serving["state_dir"] == str(config.state_dir)
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o660

        serving_status = health_pb2.HealthCheckResponse.SERVING
        assert _health(health_port, "") == serving_status
        assert _health(health_port, SERVICE_NAME) == serving_status
        assert _propose_one_rank(unix_target, "image/unix") == pb.ACTION_BUILD
        assert _propose_one_rank(tcp_target, "image/tcp") == pb.ACTION_BUILD
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        assert "moe_sidecar_groups 2.0" in metrics.read().decode()
        assert (config.state_dir / "sidecar.sqlite3").exists()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
            raise
    assert code == 0, log.read_text()
    assert not socket_path.exists(), "the socket is removed on a clean stop"


# --- the example inference stage -----------------------------------------------------------

INFERENCE_DOCKERFILE = REPO / "docker" / "Dockerfile.inference"


def test_inference_stage_prewarms_the_module_its_processes_will_load() -> None:
    from moe_sidecar.client.backends.flashinfer import SUPPORTED_FLASHINFER
    from moe_sidecar.client.prewarm import (
        BUILD_ENV,
        DEFAULT_ARCHS,
        ENV_ARCH_LIST,
        ENV_WORKSPACE_BASE,
        cache_paths,
        parse_arch_flags,
    )

    [stage] = parse_dockerfile(INFERENCE_DOCKERFILE)
    # vLLM's image; the build checks that it has nvcc (FlashInfer's JIT needs it,
    # and FlashInfer also runs ninja at run time).
    assert stage.base == "vllm/vllm-openai:v0.33.0", stage.base
    runs = [r.arguments for r in stage.all("RUN")]
    assert runs[0] == "nvcc --version"
    env = stage.env({"PATH": "/usr/local/cuda/bin:/usr/bin:/bin"})
    base = env[ENV_WORKSPACE_BASE]
    assert base.startswith("/") and env["CUDA_HOME"] == "/usr/local/cuda"
    # Nothing that would point the processes at another cache directory or
    # make FlashInfer skip or change the build.
    assert ENV_ARCH_LIST not in env and "FLASHINFER_DISABLE_JIT" not in env
    assert not {k for k in env if k in BUILD_ENV} - {"CUDA_HOME"}, env

    runs = [r.arguments for r in stage.all("RUN")]
    installs = [shlex.split(r) for r in runs if "pip install" in r]
    assert len(installs) == 1
    targets = [w for w in installs[0][installs[0].index("install") + 1 :] if not w.startswith("-")]
    # The plugin's extra: vLLM's own torch and FlashInfer stay as the image has them.
    assert targets == [".[vllm]"], installs
    # The same build context as the sidecar image (whose .dockerignore test
    # checks that every copied file reaches it).
    assert set(_copy_sources(stage)) == set(_copy_sources(STAGES[0]))

    # prewarm: after the install, as the image's user, which owns the cache directory.
    order = [(i.keyword, i.arguments) for i in stage.instructions]
    prewarm_at = next(i for i, (k, a) in enumerate(order) if k == "RUN" and "prewarm" in a)
    install_at = next(i for i, (k, a) in enumerate(order) if k == "RUN" and "pip install" in a)
    user_at = max(i for i, (k, _) in enumerate(order) if k == "USER")
    assert install_at < user_at < prewarm_at
    uid, _, gid = stage.all("USER")[-1].arguments.partition(":")
    assert uid.isdigit() and int(uid) != 0
    assert re.search(rf"install -d -o {uid} -g {gid} -m 0755 {re.escape(base)}\b", " ".join(runs))
    argv = shlex.split(order[prewarm_at][1])
    assert argv[0] == "moe-sidecar"
    args = cli.build_parser().parse_args(argv[1:])
    assert args.command == "prewarm" and args.workspace_base is None and not args.ignore_aot
    built = parse_arch_flags(args.arch)
    assert built == parse_arch_flags(DEFAULT_ARCHS), "Hopper and Blackwell, one build each"
    dirs = {cache_paths(Path(base), SUPPORTED_FLASHINFER, t).workspace_dir for t in built}
    assert dirs == {
        Path(base) / ".cache" / "flashinfer" / SUPPORTED_FLASHINFER / arch
        for arch in ("90a", "100a")
    }
