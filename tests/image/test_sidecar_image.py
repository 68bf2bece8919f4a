"""The built sidecar image, run: as the image says, and as the DaemonSet runs it.

The image is ``$SIDECAR_TEST_IMAGE`` (``scripts/build-image.sh`` builds it from
``docker/Dockerfile``; ``.ci/run`` does so before the tests). Each test starts
real containers with podman in a pod of their own (``tests/image/pod.py``):
the DaemonSet's sidecar with the manifest's security context, volumes,
environment, resource limits and probes, after the init container that owns
its state directory. From the host, the tests talk to the sidecar through the
Unix socket in its bind-mounted volume, as the inference ranks do; the
kubelet's probes and the metrics scrape dial the pod's address inside the
pod's network namespace. No traffic leaves loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.core.defaults import ENV_TARGET
from moe_sidecar.servicer import SERVICE_NAME
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.image.pod import POD_IP, Pod, image_config, podman
from tests.integration.helpers import BF16, NVFP4, propose_request, workspace_bytes
from tests.integration.test_docker_entrypoint import FINAL, image_command, image_env
from tests.integration.test_shutdown_and_sockets import _until_waiting_ranks
from tests.unit.test_k8s_manifests import (
    NODE_NAME,
    POD,
    WORKLOAD,
    _inference,
    _sidecar,
    _sidecar_config,
)

pytestmark = [pytest.mark.image, pytest.mark.timeout(300)]

SIDECAR = _sidecar()
GRACE_SECONDS = float(POD["terminationGracePeriodSeconds"])
SERVING = health_pb2.HealthCheckResponse.SERVING
MOE_SIDECAR = Path(sys.executable).parent / "moe-sidecar"
"""The host's CLI (this virtualenv's), talking to the container through the socket."""


def _socket_in_container() -> Path:
    unix = [a.unix_path for a in _sidecar_config().listen_addresses if a.unix_path is not None]
    assert len(unix) == 1, "the sidecar listens on one Unix socket"
    return unix[0]


def _host_side(pod: Pod, container: dict[str, Any], path: Path) -> Path:
    """Where ``path`` inside ``container`` lies on the host: on one of its volumes."""
    for mount in container.get("volumeMounts", []):
        mounted = Path(mount["mountPath"])
        if path.is_relative_to(mounted):
            return pod.volume_path(mount["name"]) / path.relative_to(mounted)
    raise AssertionError(f"{path} is on none of {container['name']}'s volumes")


def _socket_target(pod: Pod) -> str:
    return f"unix://{_host_side(pod, SIDECAR, _socket_in_container())}"


def _health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(reply.status)


def _groups(target: str) -> list[dict[str, Any]]:
    """``moe-sidecar groups --json`` from the host."""
    done = subprocess.run(
        [str(MOE_SIDECAR), "groups", "--json", "--target", target],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def _propose(target: str, requirement: pb.Requirement, lifetime: str) -> pb.ProposeResponse:
    """One round of a one-rank group from the host, through ``target``."""
    request = propose_request(
        0, 1, requirement, group="image/restart", ep_size=1, local_ranks=1, lifetime=lifetime
    )
    with grpc.insecure_channel(target) as channel:
        answer: pb.ProposeResponse = pb_grpc.WorkspaceCoordinatorStub(channel).Propose(
            request, timeout=10
        )
    return answer


def _log_records(pod: Pod, name: str) -> list[dict[str, Any]]:
    # Every line is JSON: the manifest's (and the image's) log format.
    return [json.loads(line) for line in pod.logs(name).splitlines() if line.strip()]


def _port(container: dict[str, Any], name: str) -> int:
    [port] = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


# --- the image as built ------------------------------------------------------------


def test_the_image_starts_as_its_dockerfile_says(pod: Pod, sidecar_image: str) -> None:
    config = image_config(sidecar_image)
    assert config["User"] == FINAL.all("USER")[-1].arguments
    assert config["Entrypoint"] == image_command()
    assert not config.get("Cmd")
    assert set(config["ExposedPorts"]) == {
        f"{p}/tcp" for e in FINAL.all("EXPOSE") for p in e.arguments.split()
    }
    assert set(config["Volumes"]) == {v for i in FINAL.all("VOLUME") for v in i.exec_form()}
    env = dict(item.partition("=")[::2] for item in config["Env"])
    for key, value in image_env().items():
        if key == "PATH":
            # The base's own PATH is the mmdebstrap base's, not python:3.11-slim's.
            prefix = value.partition(":")[0]
            assert env[key].startswith(prefix + ":"), env[key]
        else:
            assert env[key] == value, key

    # Nothing but the image: its user, entrypoint and environment, a socket
    # directory owned by the image's user, anonymous volumes for the rest.
    uid, _, gid = config["User"].partition(":")
    socket_dir = pod.root / "plain-socket"
    socket_dir.mkdir(mode=0o770)
    socket_dir.chmod(0o770)
    os.chown(socket_dir, int(uid), int(gid))
    in_container = _socket_in_container()
    name = pod.start_plain({socket_dir: str(in_container.parent)})
    target = f"unix://{socket_dir / in_container.name}"
    # On loopback: where the image's health port listens, whatever else it binds.
    health_port = int(env["MOE_SIDECAR_HEALTH_PORT"])
    startup = pod.probe(
        {"grpc": {"port": health_port}, "periodSeconds": 1, "failureThreshold": 30}, "127.0.0.1"
    )
    assert startup["status"] == "SERVING", (startup, pod.logs(name))

    status = podman("exec", name, "cat", "/proc/1/status").stdout
    ids = {line.split(":")[0]: line.split()[1:] for line in status.splitlines()}
    assert ids["Uid"] == [uid] * 4 and ids["Gid"] == [gid] * 4, status
    cmdline = podman("exec", name, "cat", "/proc/1/cmdline").stdout.split("\0")[:-1]
    entrypoint = image_command()
    # A console script: the venv's python runs the script the image's PATH finds first.
    assert cmdline[-len(entrypoint) :] == [
        f"{env['PATH'].partition(':')[0]}/{entrypoint[0]}",
        *entrypoint[1:],
    ], cmdline
    environ = podman("exec", name, "cat", "/proc/1/environ").stdout.split("\0")
    assert set(config["Env"]) <= set(environ)

    assert _health(target, "") == SERVING
    assert _health(target, SERVICE_NAME) == SERVING
    assert _groups(target) == []
    code, _ = pod.stop(name, GRACE_SECONDS)
    assert code == 0, pod.logs(name)


# --- the DaemonSet's pod ------------------------------------------------------------


def test_the_daemonset_sidecar_serves_its_probes_socket_and_metrics(pod: Pod) -> None:
    name = pod.start_sidecar()  # the state owner, then the sidecar, until its startup probe
    declared = {p["containerPort"] for p in SIDECAR["ports"]}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = SIDECAR[kind]
        assert probe["grpc"]["port"] in declared, kind
        result = pod.probe(probe)
        assert result["status"] == "SERVING", (kind, result, pod.logs(name))

    metrics_port = _port(SIDECAR, "metrics")
    annotations = WORKLOAD["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == metrics_port
    scrape = pod.http_get(metrics_port, annotations["prometheus.io/path"])
    assert scrape["status"] == 200, scrape
    assert "moe_sidecar_groups 0.0" in scrape["body"]

    # The inference ranks' way in: the socket on the shared volume.
    target = _socket_target(pod)
    assert _health(target, "") == SERVING
    assert _health(target, SERVICE_NAME) == SERVING
    assert _groups(target) == []
    assert _propose(target, NVFP4, "first-lifetime").action == pb.ACTION_BUILD
    [group] = _groups(target)
    assert group["name"] == "image/restart"
    assert group["plan"]["origin"]["node"] == NODE_NAME, "the node's name from the downward API"
    scrape = pod.http_get(metrics_port, annotations["prometheus.io/path"])
    assert "moe_sidecar_groups 1.0" in scrape["body"]

    # The coordinator's TCP listener (for `kubectl port-forward`) is on the
    # pod's loopback only: reachable there, not on the pod's address.
    [tcp] = [a for a in _sidecar_config().listen_addresses if a.unix_path is None]
    assert tcp.host == "127.0.0.1", tcp
    local = pod.in_network(str(MOE_SIDECAR), "groups", "--json", "--target", tcp.target, timeout=30)
    assert local.returncode == 0, local.stderr
    assert [g["name"] for g in json.loads(local.stdout)] == ["image/restart"]
    outside = f"{POD_IP}:{tcp.target.rpartition(':')[2]}"
    refused = pod.in_network(
        str(MOE_SIDECAR), "groups", "--target", outside, "--timeout", "2", timeout=30
    )
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr, refused

    # The inference container's view: its user, its security context and the
    # pod's fsGroup, the socket volume where it mounts it, its MOE_SIDECAR_TARGET.
    inference = _inference()
    socket_volume = next(
        m for m in SIDECAR["volumeMounts"] if _socket_in_container().is_relative_to(m["mountPath"])
    )["name"]
    view = {
        "name": "inference-view",
        "image": SIDECAR["image"],
        "securityContext": inference["securityContext"],
        "env": [e for e in inference["env"] if e["name"] == ENV_TARGET],
        "volumeMounts": [m for m in inference["volumeMounts"] if m["name"] == socket_volume],
        "command": ["moe-sidecar", "groups", "--json"],
    }
    seen = json.loads(pod.run_to_completion(view))
    assert [g["name"] for g in seen] == ["image/restart"]

    code, _ = pod.stop(name, GRACE_SECONDS)
    assert code == 0, pod.logs(name)


def test_plans_survive_a_sidecar_restart_on_the_state_volume(pod: Pod) -> None:
    name = pod.start_sidecar()
    target = _socket_target(pod)
    first = _propose(target, BF16, "before-the-restart")
    assert first.action == pb.ACTION_BUILD
    [before] = _groups(target)
    code, _ = pod.stop(name, GRACE_SECONDS)
    assert code == 0, pod.logs(name)

    # The kubelet restarts the container in the same pod: same volumes, no init containers.
    restarted = pod.start(SIDECAR)
    assert pod.probe(SIDECAR["startupProbe"])["status"] == "SERVING", pod.logs(restarted)
    [after] = _groups(target)
    assert after["plan"] == before["plan"] and after["generation"] == before["generation"]
    serving = next(r for r in _log_records(pod, restarted) if r["message"] == "serving")
    assert serving["groups"] == 1
    # A new lifetime with a smaller layer starts from the stored union: one build of it.
    again = _propose(target, NVFP4, "after-the-restart")
    assert again.action == pb.ACTION_BUILD
    assert again.plan.workspace_bytes == workspace_bytes(BF16.capacities, 1)
    assert again.plan.generation == first.plan.generation
    code, _ = pod.stop(restarted, GRACE_SECONDS)
    assert code == 0, pod.logs(restarted)


def test_sigterm_drains_within_the_grace_period_and_exits_0(pod: Pod) -> None:
    assert _sidecar_config().grace_period < GRACE_SECONDS, "the drain fits the pod's grace"
    name = pod.start_sidecar()
    target = _socket_target(pod)
    socket = Path(target.removeprefix("unix://"))
    request = propose_request(0, 1, NVFP4, group="image/drain", ep_size=2, local_ranks=2)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.WorkspaceCoordinatorStub(channel)
        # Rank 0 waits in an open round for a rank 1 that never comes.
        waiting = stub.Propose.future(request, timeout=60)
        _until_waiting_ranks(stub, "image/drain", 1)
        started = time.monotonic()
        code, stop_seconds = pod.stop(name, GRACE_SECONDS)
        error = waiting.exception(timeout=10)
    assert code == 0, pod.logs(name)
    assert stop_seconds < GRACE_SECONDS, f"stopped by SIGKILL after {stop_seconds:.1f} s"
    assert time.monotonic() - started < GRACE_SECONDS
    assert isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "shutting down" in (error.details() or "")
    messages = [(r["message"], r.get("signal")) for r in _log_records(pod, name)]
    assert ("shutdown requested", "SIGTERM") in messages
    assert messages[-1] == ("stopped", None)
    assert not socket.exists(), "the socket is removed on a clean stop"
