"""Every manifest in ``docker/k8s/`` parses and agrees with the sidecar itself.

Ports, paths, env names, probes and the socket are read from the manifests
and compared with what ``moe-sidecar serve`` makes of the same environment
(``config_from_flags``), with ``SidecarConfig``'s defaults, with the image
(``docker/Dockerfile``) and with the client library's env names, so a
renamed flag, a moved port or a typo in a path fails here, not in a cluster.
The inference container is vLLM with the plugin (``docker/inference.Dockerfile``)
started with the one-sided all-to-all the plugin replaces, with the plugin on.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from moe_sidecar import cli
from moe_sidecar.client.vllm_plugin import plugin_mode
from moe_sidecar.config import SidecarConfig, config_from_flags
from moe_sidecar.defaults import (
    CLIENT_ENV_KEYS,
    ENV_BACKEND,
    ENV_GROUP,
    ENV_LOCAL_RANKS,
    ENV_PREFIX,
    ENV_PROPOSE_TIMEOUT,
    ENV_TARGET,
    ENV_VLLM,
)
from moe_sidecar.servicer import SERVICE_NAME
from tests.dockerfile import REPO, parse_dockerfile

pytestmark = pytest.mark.timeout(60)

K8S = REPO / "docker" / "k8s"
FILES = sorted(K8S.glob("*.yaml"))


def _documents() -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in FILES:
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                found.append((path, document))
    return found


DOCUMENTS = _documents()


def _one(kind: str) -> dict[str, Any]:
    matches = [d for _, d in DOCUMENTS if d["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


WORKLOAD = _one("DaemonSet")
POD = WORKLOAD["spec"]["template"]["spec"]
SIDECARS: list[dict[str, Any]] = [
    c for c in POD.get("initContainers", []) if c.get("restartPolicy") == "Always"
]
INFERENCE: list[dict[str, Any]] = [c for c in POD["containers"] if c["name"] == "inference"]


def _env(container: dict[str, Any]) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        assert "value" in item and isinstance(item["value"], str), f"{item}: a quoted string value"
        env[item["name"]] = item["value"]
    return env


def _sidecar() -> dict[str, Any]:
    assert len(SIDECARS) == 1, "one native sidecar: an init container with restartPolicy Always"
    return SIDECARS[0]


def _inference() -> dict[str, Any]:
    assert len(INFERENCE) == 1
    return INFERENCE[0]


def _sidecar_config() -> SidecarConfig:
    # What `moe-sidecar serve` (the image's entrypoint) makes of this env;
    # raises on an unknown MOE_SIDECAR_* name or a malformed value.
    return config_from_flags(cli.build_parser().parse_args(["serve"]), _env(_sidecar()))


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def _volumes() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in POD["volumes"]}


def _quantity(value: object) -> float:
    text = str(value)
    units = {
        "m": 1e-3,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
    }
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    assert match, f"not a quantity: {text!r}"
    number, unit = match.groups()
    return float(number) * (units[unit] if unit else 1)


# --- every file ---------------------------------------------------------------------


def test_every_manifest_parses_and_the_kustomization_lists_them_all() -> None:
    assert FILES, "no manifests"
    for path, document in DOCUMENTS:
        assert {"apiVersion", "kind"} <= set(document), path
        if document["kind"] != "Kustomization":
            assert document["metadata"]["name"], path
    kustomization = _one("Kustomization")
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in FILES if p.name != "kustomization.yaml"}


# --- the pod --------------------------------------------------------------------------


def test_one_pod_per_gpu_node_with_the_sidecar_as_a_native_sidecar() -> None:
    assert POD["nodeSelector"], "a DaemonSet on the GPU nodes only"
    sidecar = _sidecar()
    version = importlib.metadata.version("moe-sidecar")
    assert sidecar["image"].rsplit("/", 1)[-1] == f"moe-sidecar:{version}"
    # The image's ENTRYPOINT runs `moe-sidecar serve`; the manifest adds nothing to it.
    assert "command" not in sidecar and "args" not in sidecar


def test_sidecar_env_is_what_the_cli_and_the_image_use() -> None:
    env = _env(_sidecar())
    assert all(k.startswith(ENV_PREFIX) for k in env), env
    config = _sidecar_config()
    defaults = SidecarConfig()
    assert config.health_port == defaults.health_port
    assert config.metrics_port == defaults.metrics_port
    assert config.state_dir == defaults.state_dir
    # Spelled-out values are the image's own (docker/Dockerfile's ENV).
    image_env = parse_dockerfile()[-1].env({})
    for key, value in env.items():
        if key in image_env:
            assert value == image_env[key], key
    # The coordinator listens on the socket and on loopback only.
    tcp_hosts = [a.host for a in config.listen_addresses if a.unix_path is None]
    assert set(tcp_hosts) <= {"127.0.0.1", "[::1]", "localhost"}


def test_ports_and_grpc_probes_use_the_health_and_metrics_ports() -> None:
    sidecar = _sidecar()
    config = _sidecar_config()
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"health": config.health_port, "metrics": config.metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc_probe = sidecar[probe]["grpc"]
        assert grpc_probe["port"] == config.health_port, probe
        assert grpc_probe.get("service", "") in ("", SERVICE_NAME), probe
    assert sidecar["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


def test_the_inference_container_reaches_the_sidecar_socket() -> None:
    config = _sidecar_config()
    [socket_address] = [a for a in config.listen_addresses if a.unix_path is not None]
    assert socket_address.unix_path is not None
    socket_dir = str(socket_address.unix_path.parent)
    inference = _inference()
    env = _env(inference)
    assert env[ENV_TARGET] == socket_address.target
    # Both mount one emptyDir at the socket's directory.
    sidecar_volume = _mounts(_sidecar())[socket_dir]
    assert _mounts(inference)[socket_dir] == sidecar_volume
    assert "emptyDir" in _volumes()[sidecar_volume]
    # The socket is mode 0660 owned by the sidecar's uid:gid; the inference
    # process must hold that gid.
    sidecar_gid = _sidecar()["securityContext"]["runAsGroup"]
    groups = {inference["securityContext"].get("runAsGroup"), POD["securityContext"].get("fsGroup")}
    groups |= set(POD["securityContext"].get("supplementalGroups", []))
    assert sidecar_gid in groups
    # Client settings: the client's own names, and consistent with the sidecar.
    client_keys = {k for k in env if k.startswith(ENV_PREFIX)}
    assert (
        client_keys
        <= {ENV_TARGET, ENV_LOCAL_RANKS, ENV_PROPOSE_TIMEOUT, ENV_GROUP}
        <= (CLIENT_ENV_KEYS)
    )
    assert float(env[ENV_PROPOSE_TIMEOUT]) > config.round_timeout
    gpus = inference["resources"]["limits"]["nvidia.com/gpu"]
    assert int(env[ENV_LOCAL_RANKS]) == int(gpus), "every GPU of the pod is one local rank"


def test_state_and_jit_cache_live_on_volumes() -> None:
    config = _sidecar_config()
    volumes = _volumes()
    assert str(config.state_dir) in _mounts(_sidecar())
    inference = _inference()
    cache = _env(inference)["FLASHINFER_WORKSPACE_BASE"]
    assert cache in _mounts(inference)
    # Every mount names a volume, and every volume is mounted somewhere.
    mounted = set()
    for container in [*POD.get("initContainers", []), *POD["containers"]]:
        for name in _mounts(container).values():
            assert name in volumes, f"{container['name']} mounts unknown volume {name}"
            mounted.add(name)
    assert mounted == set(volumes)


@pytest.mark.parametrize("which", ["sidecar", "inference"])
def test_containers_are_locked_down_and_sized(which: str) -> None:
    container = _sidecar() if which == "sidecar" else _inference()
    context = container["securityContext"]
    assert context["runAsNonRoot"] is True and POD["securityContext"]["runAsNonRoot"] is True
    assert context["runAsUser"] != 0
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context.get("privileged", False) is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    for scope in (context, POD["securityContext"]):
        assert scope["seccompProfile"] == {"type": "RuntimeDefault"}
    resources = container["resources"]
    for resource in ("cpu", "memory"):
        request = _quantity(resources["requests"][resource])
        limit = _quantity(resources["limits"][resource])
        assert 0 < request <= limit, (resource, request, limit)


def test_the_sidecar_runs_as_the_image_user() -> None:
    user = parse_dockerfile()[-1].all("USER")[-1].arguments
    uid, _, gid = user.partition(":")
    context = _sidecar()["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"]) == (int(uid), int(gid))


def test_metrics_are_scraped_from_the_metrics_port() -> None:
    config = _sidecar_config()
    template = WORKLOAD["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    monitor = _one("PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    assert (
        WORKLOAD["spec"]["selector"]["matchLabels"].items()
        <= template["metadata"]["labels"].items()
    )
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in _sidecar()["ports"]}
    assert ports[endpoint["port"]] == config.metrics_port
    assert endpoint["path"] == "/metrics"


# --- vLLM with the plugin -------------------------------------------------------------

INFERENCE_DOCKERFILE = REPO / "docker" / "inference.Dockerfile"


def _flag(args: list[str], name: str) -> str:
    assert name in args, f"vllm serve needs {name}"
    return args[args.index(name) + 1]


def test_the_inference_image_is_vllm_with_the_plugin_extra() -> None:
    [stage] = parse_dockerfile(INFERENCE_DOCKERFILE)
    # The vLLM release whose code the CPU tests run (tests/vllm).
    assert stage.base == "vllm/vllm-openai:v0.33.0"
    assert [i.arguments for i in stage.all("RUN")] == ["pip install 'moe-sidecar[vllm]'"]
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert "vllm" in project["optional-dependencies"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"moe_sidecar": "moe_sidecar.client.vllm_plugin:register"}


def test_vllm_serves_with_the_one_sided_all_to_all_and_the_plugin_on() -> None:
    inference = _inference()
    assert inference["image"].rsplit("/", 1)[-1].startswith("vllm-moe-sidecar:")
    assert inference["command"] == ["vllm", "serve"]
    args = [str(a) for a in inference["args"]]
    assert not args[0].startswith("-"), "the model comes first"
    assert _flag(args, "--all2all-backend") == "flashinfer_nvlink_one_sided"
    assert "--enable-expert-parallel" in args
    env = _env(inference)
    # The plugin acts in sidecar mode, with FlashInfer's backend (the default).
    assert plugin_mode(env) == "sidecar"
    assert env.get(ENV_VLLM, "1") != "0" and env.get(ENV_BACKEND, "flashinfer") == "flashinfer"
    # One DP rank per GPU, all in this pod: the EP group is the pod's GPUs.
    gpus = int(inference["resources"]["limits"]["nvidia.com/gpu"])
    assert int(_flag(args, "--data-parallel-size")) == gpus == int(env[ENV_LOCAL_RANKS])
    # The model's weights come from a read-only volume.
    [model_mount] = [m for m in inference["volumeMounts"] if args[0].startswith(m["mountPath"])]
    assert model_mount["readOnly"] is True
