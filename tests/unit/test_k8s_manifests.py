"""Every manifest in ``docker/k8s/`` (and ``docker/k8s-etcd/``) parses and agrees
with the sidecar itself.

Ports, paths, env names, probes and the socket are read from the manifests
and compared with what ``moe-sidecar serve`` makes of the same environment
(``config_from_flags``), with ``SidecarConfig``'s defaults, with the image
(``docker/Dockerfile``) and with the client library's env names, so a
renamed flag, a moved port or a typo in a path fails here, not in a cluster.

FlashInfer's JIT cache: the node volume, its two init containers and the
inference container are checked against FlashInfer's cache layout as
``client.prewarm`` computes it, against ``moe-sidecar prewarm``'s own parser
and against ``docker/Dockerfile.inference``; the seeding script runs for real
(as the kubelet would pass it) on a cache laid out in a temporary directory.


The inference container is vLLM with the plugin (``docker/Dockerfile.inference``)
started with the one-sided all-to-all the plugin replaces, with the plugin on.

The kustomize layout is checked too: the base needs no CRD, every optional
part is a component, and the etcd component's URL names the example etcd.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from moe_sidecar import cli
from moe_sidecar.client.backends.flashinfer import SUPPORTED_FLASHINFER
from moe_sidecar.client.engines.vllm.plugin import plugin_mode
from moe_sidecar.client.engines.vllm.settings import ENV_VLLM
from moe_sidecar.client.prewarm import (
    ENV_WORKSPACE_BASE,
    cache_paths,
    flashinfer_cache_dir,
    make_plan,
    parse_arch_flags,
)
from moe_sidecar.config import SidecarConfig, SqliteStore, config_from_flags
from moe_sidecar.core.defaults import (
    CLIENT_ENV_KEYS,
    ENV_BACKEND,
    ENV_GROUP,
    ENV_LOCAL_RANKS,
    ENV_PREFIX,
    ENV_PROPOSE_TIMEOUT,
    ENV_TARGET,
)
from moe_sidecar.etcd.url import EtcdTarget
from moe_sidecar.servicer import SERVICE_NAME
from moe_sidecar.wire.address import is_loopback
from tests.dockerfile import REPO, parse_dockerfile

pytestmark = pytest.mark.timeout(60)

K8S = REPO / "docker" / "k8s"
K8S_ETCD = REPO / "docker" / "k8s-etcd"
FILES = sorted([*K8S.rglob("*.yaml"), *K8S_ETCD.rglob("*.yaml")])
NODE_NAME = "gpu-node-1"
"""What a ``spec.nodeName`` field reference gives the sidecar here."""


def _documents() -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in FILES:
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                found.append((path, document))
    return found


DOCUMENTS = _documents()


def _one(kind: str, path: Path | None = None) -> dict[str, Any]:
    matches = [d for p, d in DOCUMENTS if d["kind"] == kind and path in (None, p)]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


def _kustomization(directory: Path) -> dict[str, Any]:
    return _one(
        "Kustomization" if directory in (K8S, K8S_ETCD) else "Component",
        directory / "kustomization.yaml",
    )


WORKLOAD = _one("DaemonSet", K8S / "inference-daemonset.yaml")
POD = WORKLOAD["spec"]["template"]["spec"]
SIDECARS: list[dict[str, Any]] = [
    c for c in POD.get("initContainers", []) if c.get("restartPolicy") == "Always"
]
INFERENCE: list[dict[str, Any]] = [c for c in POD["containers"] if c["name"] == "inference"]
INIT: dict[str, dict[str, Any]] = {c["name"]: c for c in POD.get("initContainers", [])}
INFERENCE_DOCKERFILE = REPO / "docker" / "Dockerfile.inference"


def _env(container: dict[str, Any]) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            # Only the node's name comes from the pod's own fields.
            assert item["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}, item
            env[item["name"]] = NODE_NAME
            continue
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


def _referenced(directory: Path) -> set[Path]:
    """The files and directories a kustomization (or component) names."""
    document = _kustomization(directory)
    names = [*document.get("resources", []), *document.get("components", [])]
    names += [patch["path"] for patch in document.get("patches", [])]
    return {(directory / name).resolve() for name in names}


def test_every_manifest_parses_and_a_kustomization_lists_each() -> None:
    assert FILES, "no manifests"
    for path, document in DOCUMENTS:
        assert {"apiVersion", "kind"} <= set(document), path
        if document["kind"] not in ("Kustomization", "Component"):
            assert document["metadata"]["name"], path
    roots = [p.parent for p in FILES if p.name == "kustomization.yaml"]
    referenced = set().union(*(_referenced(root) for root in roots))
    for path in referenced:
        assert path.exists(), f"a kustomization names {path}, which does not exist"
    listed = {p.resolve() for p in FILES if p.name != "kustomization.yaml"}
    assert listed <= referenced, listed - referenced


def test_the_base_needs_no_crd_and_optional_parts_are_components() -> None:
    # `kubectl apply -k docker/k8s` works on a cluster without the Prometheus Operator.
    base = _kustomization(K8S)
    assert base["resources"] == ["inference-daemonset.yaml", "models-pvc.yaml"]
    assert "components" not in base
    base_kinds = {d["kind"] for p, d in DOCUMENTS if p.parent == K8S}
    assert base_kinds == {"DaemonSet", "PersistentVolumeClaim", "Kustomization"}
    components = sorted({p.parent for p in FILES if p.parent.parent == K8S / "components"})
    assert [c.name for c in components] == ["etcd-server", "etcd-store", "prometheus-operator"]
    text = (K8S / "kustomization.yaml").read_text()
    for component in components:
        assert _kustomization(component)["kind"] == "Component"
        assert f"components/{component.name}" in text, "the base's comments list every component"
    monitor_at = {p for p, d in DOCUMENTS if d["kind"] == "PodMonitor"}
    assert monitor_at == {K8S / "components" / "prometheus-operator" / "podmonitor.yaml"}
    # docker/k8s-etcd: the base plus the etcd components, beside the base (not in it).
    assert _referenced(K8S_ETCD) == {
        K8S.resolve(),
        (K8S / "components" / "etcd-store").resolve(),
        (K8S / "components" / "etcd-server").resolve(),
    }


def test_the_base_makes_the_models_claim_the_pods_mount_read_only() -> None:
    # Without it every pod stays Pending on a claim no manifest makes.
    claim = _one("PersistentVolumeClaim", K8S / "models-pvc.yaml")
    [volume] = [v for v in POD["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"] == {
        "claimName": claim["metadata"]["name"],
        "readOnly": True,
    }
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]  # every node's pod at once
    # No class provisions an empty volume: it binds to the weights' volume.
    assert claim["spec"]["storageClassName"] == ""
    mounts = _mounts(_inference())
    assert mounts["/models"] == volume["name"]
    [mount] = [m for m in _inference()["volumeMounts"] if m["mountPath"] == "/models"]
    assert mount["readOnly"] is True
    assert _inference()["args"][0].startswith("/models/")
    page = (REPO / "docs" / "kubernetes.md").read_text()
    first_steps = page[: page.index("## The pod")]
    assert "docker/k8s/models-pvc.yaml" in first_steps and "ReadOnlyMany" in first_steps


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


def test_probes_and_scrapes_reach_health_and_metrics_on_the_pod_address() -> None:
    # The sidecar binds both to loopback unless told; the kubelet probes and
    # Prometheus scrapes the pod's IP, so the manifest (and the image) bind
    # every interface of the pod. The coordinator stays on the socket and loopback.
    assert is_loopback(SidecarConfig().health_host)
    assert is_loopback(SidecarConfig().metrics_host)
    config = _sidecar_config()
    assert config.health_host == "0.0.0.0"
    assert config.metrics_host == "0.0.0.0"
    image_env = parse_dockerfile()[-1].env({})
    assert image_env["MOE_SIDECAR_HEALTH_HOST"] == "0.0.0.0"
    assert image_env["MOE_SIDECAR_METRICS_HOST"] == "0.0.0.0"


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
        <= CLIENT_ENV_KEYS
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


@pytest.mark.parametrize("which", ["sidecar", "inference", "flashinfer-prewarm"])
def test_containers_are_locked_down_and_sized(which: str) -> None:
    container = {"sidecar": _sidecar(), "inference": _inference()}.get(which) or INIT[which]
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


# --- FlashInfer's JIT cache on the node ----------------------------------------------------


def _cache_init() -> dict[str, Any]:
    return INIT["flashinfer-cache"]


def _prewarm_init() -> dict[str, Any]:
    return INIT["flashinfer-prewarm"]


def _workspace_base() -> str:
    return _env(_inference())[ENV_WORKSPACE_BASE]


def _cache_volume() -> str:
    return _mounts(_inference())[_workspace_base()]


def _prewarm_targets(argv: list[str]) -> tuple[frozenset[Any], ...]:
    """The targets of a ``moe-sidecar prewarm`` command line, as the CLI parses it."""
    assert argv[0] == "moe-sidecar", argv
    args = cli.build_parser().parse_args(argv[1:])
    assert args.command == "prewarm" and args.workspace_base is None, argv
    return parse_arch_flags(args.arch)


def _image_prewarm() -> list[str]:
    [stage] = [s for s in parse_dockerfile(INFERENCE_DOCKERFILE) if s.name == "inference"]
    [argv] = [
        shlex.split(r.arguments) for r in stage.all("RUN") if r.arguments.startswith("moe-sidecar")
    ]
    return argv


def test_the_jit_cache_is_a_node_volume_where_flashinfer_looks() -> None:
    base = _workspace_base()
    volume = _volumes()[_cache_volume()]
    assert volume["hostPath"]["type"] == "DirectoryOrCreate", volume
    assert Path(volume["hostPath"]["path"]).is_absolute()
    assert "emptyDir" not in volume
    # The image's value, so the module it was built with is found at this path.
    [stage] = parse_dockerfile(INFERENCE_DOCKERFILE)
    assert stage.env({})[ENV_WORKSPACE_BASE] == base
    # prewarm writes where the inference processes read: same variable, same mount.
    prewarm = _prewarm_init()
    assert _env(prewarm)[ENV_WORKSPACE_BASE] == base
    assert _mounts(prewarm)[base] == _cache_volume()
    for target in _prewarm_targets([*prewarm["command"], *prewarm["args"]]):
        library = cache_paths(Path(base), SUPPORTED_FLASHINFER, target).library
        assert library.is_relative_to(base), library


def test_the_cache_init_seeds_from_the_image_and_hands_the_volume_to_the_inference_user() -> None:
    init, inference, prewarm = _cache_init(), _inference(), _prewarm_init()
    env = _env(init)
    base = Path(_workspace_base())
    # The seed is the image's own cache, visible because the volume is mounted elsewhere.
    assert env["SEED_DIR"] == str(flashinfer_cache_dir(base))
    assert str(base) not in _mounts(init)
    assert _mounts(init)[env["NODE_VOLUME"]] == _cache_volume()
    assert env["NODE_CACHE_DIR"] == str(flashinfer_cache_dir(Path(env["NODE_VOLUME"])))
    # ...so a copied directory keeps, in the inference container, the absolute
    # paths FlashInfer's build files recorded in the image.
    assert init["image"] == prewarm["image"] == inference["image"]
    context = inference["securityContext"]
    assert env["CACHE_OWNER"] == f"{context['runAsUser']}:{context['runAsGroup']}"
    for key in ("runAsUser", "runAsGroup"):
        assert prewarm["securityContext"][key] == context[key]
    # The image creates the cache directory for the same user (docker/Dockerfile.inference).
    [stage] = parse_dockerfile(INFERENCE_DOCKERFILE)
    created = " ".join(r.arguments for r in stage.all("RUN"))
    assert re.search(
        rf"install -d -o {context['runAsUser']} -g {context['runAsGroup']} -m 0755 {base}\b",
        created,
    )
    assert stage.all("USER")[-1].arguments == env["CACHE_OWNER"]
    # The seed comes before the prewarm, which comes before the inference container.
    names = [c["name"] for c in POD["initContainers"]]
    assert names.index("flashinfer-cache") < names.index("flashinfer-prewarm")


def test_the_prewarm_init_builds_what_the_image_built_and_needs_no_gpu() -> None:
    prewarm = _prewarm_init()
    targets = _prewarm_targets([*prewarm["command"], *prewarm["args"]])
    assert targets == _prewarm_targets(_image_prewarm())
    assert all(len(t) == 1 for t in targets), "one architecture per build (FlashInfer's dirs)"
    env = _env(prewarm)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "FLASHINFER_CUDA_ARCH_LIST" not in env and "FLASHINFER_DISABLE_JIT" not in env
    for scope in ("requests", "limits"):
        assert "nvidia.com/gpu" not in prewarm["resources"].get(scope, {})
    # A read-only root: nvcc and prewarm write temporary files to a volume.
    assert "emptyDir" in _volumes()[_mounts(prewarm)["/tmp"]]
    assert _mounts(prewarm)[env["HOME"]] == _mounts(_inference())[_env(_inference())["HOME"]]


def test_the_root_init_container_may_only_chown_and_copy() -> None:
    init = _cache_init()
    context = init["securityContext"]
    assert context["runAsUser"] == 0 and context["runAsNonRoot"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert sorted(context["capabilities"]["add"]) == ["CHOWN", "DAC_OVERRIDE", "FOWNER"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True and context.get("privileged") is False
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert list(_mounts(init).values()) == [_cache_volume()], "it touches the cache volume only"
    assert init["command"] == ["/bin/sh", "-c"] and len(init["args"]) == 1
    for resource in ("cpu", "memory"):
        assert (
            0
            < _quantity(init["resources"]["requests"][resource])
            <= _quantity(init["resources"]["limits"][resource])
        )


def _kubelet_expand(text: str, env: dict[str, str]) -> str:
    """What the kubelet passes for ``text`` in ``command``/``args``: ``$(VAR)`` of
    the container's env replaced, ``$$`` made ``$``, anything else kept
    (k8s.io/kubernetes third_party/forked/golang/expansion)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if text[i + 1] == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env.get(name, text[i : end + 1]))
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


def _lay_out_cache(cache_dir: Path, arch: str, marker: bytes) -> Path:
    """What a FlashInfer build leaves for one target (the files that matter to it)."""
    module = cache_dir / SUPPORTED_FLASHINFER / arch / "cached_ops" / "mnnvl_moe_alltoall"
    module.mkdir(parents=True)
    for name, content in (
        ("mnnvl_moe_alltoall.so", marker),
        ("build.ninja", b"ninja_required_version = 1.3\n"),
        (".ninja_log", b"# ninja log v6\n"),
        ("trtllm_moe_alltoall.cuda.o", b"obj"),
    ):
        (module / name).write_bytes(content)
        os.utime(module / name, ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
    (cache_dir / SUPPORTED_FLASHINFER / arch / "flashinfer_jit.log").write_bytes(b"")
    return module


@pytest.mark.skipif(os.geteuid() != 0, reason="the script chowns: run as root (CI is)")
def test_the_seeding_script_copies_once_keeps_mtimes_and_chowns(tmp_path: Path) -> None:
    init = _cache_init()
    env = _env(init)
    script = _kubelet_expand(init["args"][0], env)
    owner = tuple(int(x) for x in env["CACHE_OWNER"].split(":"))
    seed = tmp_path / "image" / ".cache" / "flashinfer"
    volume = tmp_path / "node"
    node_cache = volume / ".cache" / "flashinfer"
    _lay_out_cache(seed, "90a", b"hopper-from-image")
    _lay_out_cache(seed, "100a", b"blackwell-from-image")
    # A node that already has a Blackwell module (e.g. compiled by an earlier pod).
    _lay_out_cache(node_cache, "100a", b"blackwell-on-node")
    run_env = {
        **env,
        "SEED_DIR": str(seed),
        "NODE_VOLUME": str(volume),
        "NODE_CACHE_DIR": str(node_cache),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    }

    def run() -> str:
        done = subprocess.run(
            [*init["command"], script], env=run_env, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    first = run()
    assert first.splitlines() == [f"seeded {node_cache}/{SUPPORTED_FLASHINFER}/90a from the image"]
    hopper = node_cache / SUPPORTED_FLASHINFER / "90a" / "cached_ops" / "mnnvl_moe_alltoall"
    assert (hopper / "mnnvl_moe_alltoall.so").read_bytes() == b"hopper-from-image"
    # mtimes as they were: FlashInfer's ninja compares them with its logs.
    for name in ("mnnvl_moe_alltoall.so", ".ninja_log", "trtllm_moe_alltoall.cuda.o"):
        assert (hopper / name).stat().st_mtime_ns == 1_700_000_000_123_456_789, name
    blackwell = node_cache / SUPPORTED_FLASHINFER / "100a" / "cached_ops" / "mnnvl_moe_alltoall"
    assert (blackwell / "mnnvl_moe_alltoall.so").read_bytes() == b"blackwell-on-node"
    assert not list(node_cache.rglob("*.seeding")), "no half-copied directory left"
    for path in [volume, *volume.rglob("*")]:
        assert (path.stat().st_uid, path.stat().st_gid) == owner, path
    assert run() == "", "a second start copies nothing"

    # What the prewarm init container then finds on the volume: nothing to build.
    prewarm = _prewarm_init()
    plan = make_plan(
        _prewarm_targets([*prewarm["command"], *prewarm["args"]]),
        base=volume,
        version=SUPPORTED_FLASHINFER,
        arch_source="--arch",
    )
    assert [t.status for t in plan.targets] == ["already-built", "already-built"]


# --- plans that outlive the pod, and etcd ---------------------------------------------


def test_state_lives_on_the_node_and_belongs_to_the_sidecar() -> None:
    config = _sidecar_config()
    state = str(config.state_dir)
    assert isinstance(config.store_target, SqliteStore)  # the base: the node's SQLite alone
    volume = _volumes()[_mounts(_sidecar())[state]]
    assert volume["hostPath"] == {"path": state, "type": "DirectoryOrCreate"}
    # The kubelet creates it root-owned: an init container, before the sidecar,
    # gives it to the sidecar's uid:gid with CAP_CHOWN alone.
    inits = POD["initContainers"]
    [owner] = [c for c in inits if c["name"] == "sidecar-state-owner"]
    assert inits.index(owner) < inits.index(_sidecar())
    assert _mounts(owner)[state] == _mounts(_sidecar())[state]
    assert owner["image"] == _sidecar()["image"]
    sidecar = _sidecar()["securityContext"]
    script = " ".join(owner["command"])
    assert f"chown {sidecar['runAsUser']}:{sidecar['runAsGroup']} {state}" in script
    assert f"= {sidecar['runAsUser']}:{sidecar['runAsGroup']} ]" in script  # idempotent
    context = owner["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}


def test_plans_name_the_node_not_the_pod() -> None:
    assert _sidecar_config().node_name == NODE_NAME


def _patched_sidecar_env() -> dict[str, str]:
    """The sidecar's env once components/etcd-store's patch is applied."""
    patch = _one("DaemonSet", K8S / "components" / "etcd-store" / "sidecar-etcd.yaml")
    assert patch["metadata"]["name"] == WORKLOAD["metadata"]["name"]
    [container] = patch["spec"]["template"]["spec"]["initContainers"]
    assert container["name"] == _sidecar()["name"]
    assert set(container) == {"name", "env"}, "the patch adds env only"
    return {**_env(_sidecar()), **_env(container)}


def test_the_etcd_component_points_the_sidecar_at_the_example_etcd() -> None:
    config = config_from_flags(cli.build_parser().parse_args(["serve"]), _patched_sidecar_env())
    target = config.store_target
    assert isinstance(target, EtcdTarget)
    assert target.prefix == "/moe-sidecar/"
    # The node's SQLite stays the write-ahead record, on the hostPath.
    assert config.state_dir == _sidecar_config().state_dir
    service = _one("Service")
    statefulset = _one("StatefulSet")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    members = [
        f"{statefulset['metadata']['name']}-{i}.{service['metadata']['name']}"
        for i in range(statefulset["spec"]["replicas"])
    ]
    assert target.endpoints == tuple(f"{m}:{ports['client']}" for m in members)
    [etcd] = statefulset["spec"]["template"]["spec"]["containers"]
    flags = dict(arg.split("=", 1) for arg in etcd["command"][1:])
    assert flags["--initial-cluster"] == ",".join(
        f"{m.split('.')[0]}=http://{m}:{ports['peer']}" for m in members
    )
    suffix = f"$(POD_NAME).{service['metadata']['name']}"
    assert flags["--advertise-client-urls"] == f"http://{suffix}:{ports['client']}"
    assert flags["--initial-advertise-peer-urls"] == f"http://{suffix}:{ports['peer']}"
    container_ports = {p["name"]: p["containerPort"] for p in etcd["ports"]}
    assert container_ports == ports
    assert {v["metadata"]["name"] for v in statefulset["spec"]["volumeClaimTemplates"]} == {
        m["name"] for m in etcd["volumeMounts"]
    }
    pod = statefulset["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert etcd["securityContext"]["allowPrivilegeEscalation"] is False
    assert etcd["securityContext"]["readOnlyRootFilesystem"] is True
    assert etcd["securityContext"]["capabilities"] == {"drop": ["ALL"]}


# --- vLLM with the plugin -------------------------------------------------------------


def _flag(args: list[str], name: str) -> str:
    assert name in args, f"vllm serve needs {name}"
    return args[args.index(name) + 1]


def test_the_inference_image_is_vllm_with_the_plugin_extra() -> None:
    [stage] = parse_dockerfile(INFERENCE_DOCKERFILE)
    # The vLLM release whose code the CPU tests run (tests/vllm).
    assert stage.base == "vllm/vllm-openai:v0.33.0"
    runs = [i.arguments for i in stage.all("RUN")]
    assert "pip install --no-cache-dir '.[vllm]'" in runs
    assert "nvcc --version" in runs, "FlashInfer's JIT needs nvcc in the image"
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert "vllm" in project["optional-dependencies"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"moe_sidecar": "moe_sidecar.client.engines.vllm.plugin:register"}


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
