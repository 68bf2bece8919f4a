"""One pod of ``docker/k8s/inference-daemonset.yaml``, run with podman the way a kubelet runs it.

The containers come from the manifest as written: their ``securityContext``
(and the pod's), volumes, environment, command and resource limits become
``podman run`` options; a field this translation does not know is an error,
not something silently left out, so a manifest that could not run fails here.

What stands in for the cluster:

* the pod's network: a network namespace of its own (``ip netns``) whose only
  device is loopback, which also carries the pod's address (``POD_IP``). The
  kubelet's probes and the metrics scrape dial that address from inside the
  namespace (``tests/image/probe.py`` under ``nsenter``), so a listener bound
  to 127.0.0.1 only fails them as it would fail the kubelet's. No bridge, no
  iptables: nothing leaves the namespace, and the manifest's fixed ports
  clash with nothing on the machine.
* volumes: an ``emptyDir`` is a fresh directory under the pod's root, mode
  0777, given to ``fsGroup`` (group-owned, setgid) as the kubelet does; a
  ``hostPath`` is a directory under the root's ``node/`` (the node's disk),
  created root-owned 0755 by ``DirectoryOrCreate``. The tests reach the
  socket through the host side of its volume.
* images: the manifest's sidecar image is the image under test (the one
  ``scripts/build-image.sh`` built); containers of other images (the
  inference image's init containers) cannot run here and are not started.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.unit.test_k8s_manifests import POD, _env, _quantity, _sidecar, _volumes

POD_IP = "192.0.2.10"
"""The pod's address (TEST-NET-1: routed nowhere), on the namespace's loopback device."""

PROBE = Path(__file__).with_name("probe.py")

_POD_SECURITY_KEYS = {
    "runAsNonRoot",
    "runAsUser",
    "runAsGroup",
    "fsGroup",
    "fsGroupChangePolicy",
    "supplementalGroups",
    "seccompProfile",
}
_CONTAINER_SECURITY_KEYS = {
    "runAsNonRoot",
    "runAsUser",
    "runAsGroup",
    "allowPrivilegeEscalation",
    "readOnlyRootFilesystem",
    "privileged",
    "capabilities",
    "seccompProfile",
}
_CONTAINER_KEYS = {
    "name",
    "image",
    "imagePullPolicy",
    "restartPolicy",
    "command",
    "args",
    "env",
    "ports",
    "startupProbe",
    "readinessProbe",
    "livenessProbe",
    "resources",
    "securityContext",
    "volumeMounts",
}


class PodError(AssertionError):
    """The manifest asks for something this pod (or a kubelet) cannot run."""


def _run(argv: list[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        )
    return done


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman ARGS`` with runc: crun refuses hybrid cgroup hierarchies like CI's."""
    return _run(["podman", "--runtime", "runc", *args], timeout, check)


def image_config(image: str) -> dict[str, Any]:
    """The image's OCI config (User, Entrypoint, Env, ExposedPorts, Volumes)."""
    done = podman("image", "inspect", "--format", "{{json .Config}}", image)
    return dict(json.loads(done.stdout))


def _limits() -> list[str]:
    # podman's default ulimits (and --ulimit host) exceed what runc may set on
    # a machine like CI's: open files up to the host's hard limit, processes
    # up to kernel.pid_max as well (one more was refused there).
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
    flags = ["--ulimit", f"nproc={nproc}:{nproc}"]
    if nofile != resource.RLIM_INFINITY:
        flags += ["--ulimit", f"nofile={nofile}:{nofile}"]
    return flags


def _seccomp(context: dict[str, Any]) -> None:
    profile = context.get("seccompProfile")
    if profile is not None and profile != {"type": "RuntimeDefault"}:
        # podman's default profile is the runtime default; others need a file.
        raise PodError(f"seccompProfile {profile}: only RuntimeDefault runs here")


@dataclass
class Pod:
    """The pod's network namespace, volumes and containers; ``close`` removes them."""

    root: Path
    image: str
    netns: str = field(default_factory=lambda: f"moe-image-{uuid.uuid4().hex[:10]}")
    containers: list[str] = field(default_factory=list)
    spec: dict[str, Any] = field(default_factory=lambda: POD)

    def __post_init__(self) -> None:
        unknown = set(self.spec.get("securityContext", {})) - _POD_SECURITY_KEYS
        if unknown:
            raise PodError(f"pod securityContext {sorted(unknown)}: teach tests/image/pod.py")
        _run(["ip", "netns", "add", self.netns], 30)
        _run(["ip", "-n", self.netns, "link", "set", "lo", "up"], 30)
        _run(["ip", "-n", self.netns, "addr", "add", f"{POD_IP}/32", "dev", "lo"], 30)

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    # --- volumes ----------------------------------------------------------------

    def volume_path(self, name: str) -> Path:
        """The host side of the volume ``name``, created as the kubelet creates it.

        Raises:
            PodError: a volume kind or hostPath type the kubelet here cannot make.
        """
        volume = _volumes()[name]
        fs_group = self.spec.get("securityContext", {}).get("fsGroup")
        if "emptyDir" in volume:
            path = self.root / "volumes" / name
            if not path.exists():
                path.mkdir(parents=True)
                path.chmod(0o777)
                if fs_group is not None:
                    os.chown(path, 0, int(fs_group))
                    path.chmod(0o2777)
            return path
        if "hostPath" in volume:
            source = volume["hostPath"]
            if source.get("type") != "DirectoryOrCreate":
                raise PodError(f"volume {name}: hostPath type {source.get('type')!r}")
            path = self.root / "node" / str(source["path"]).lstrip("/")
            if not path.exists():
                path.mkdir(parents=True)
                path.chmod(0o755)
            return path
        raise PodError(f"volume {name}: {sorted(volume)} is not an emptyDir or a hostPath")

    # --- containers -------------------------------------------------------------

    def run_args(self, container: dict[str, Any]) -> list[str]:
        """``podman run`` options (before the image) for ``container`` of this pod.

        Raises:
            PodError: a field it does not know, or one a kubelet would refuse.
        """
        unknown = set(container) - _CONTAINER_KEYS
        if unknown:
            raise PodError(f"container {container['name']}: {sorted(unknown)}: teach pod.py")
        pod_context = self.spec.get("securityContext", {})
        context = container.get("securityContext", {})
        unknown = set(context) - _CONTAINER_SECURITY_KEYS
        if unknown:
            raise PodError(f"container {container['name']} securityContext {sorted(unknown)}")
        _seccomp(pod_context)
        _seccomp(context)
        flags = ["--network", f"ns:{self.netns_path}", "--pull", "never", *_limits()]

        uid = context.get("runAsUser", pod_context.get("runAsUser"))
        gid = context.get("runAsGroup", pod_context.get("runAsGroup"))
        non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot", False))
        if uid is None:
            user = image_config(self.image).get("User", "")
            image_uid, _, image_gid = user.partition(":")
            if not image_uid.isdigit():
                # The kubelet verifies runAsNonRoot against a numeric uid only.
                raise PodError(f"image user {user!r}: give runAsUser or a numeric USER")
            uid = int(image_uid)
            gid = gid if gid is not None else (image_gid or None)
        if non_root and int(uid) == 0:
            raise PodError(f"container {container['name']}: runAsNonRoot with uid 0")
        # No group given: the runtime's choice (the uid's group in the image), as under a kubelet.
        flags += ["--user", f"{uid}:{gid}" if gid is not None else str(uid)]
        groups = [pod_context.get("fsGroup"), *pod_context.get("supplementalGroups", [])]
        for group in groups:
            if group is not None:
                flags += ["--group-add", str(group)]

        if context.get("privileged"):
            raise PodError(f"container {container['name']}: privileged")
        if context.get("readOnlyRootFilesystem"):
            # Only the manifest's volumes are writable: no tmpfs of podman's own.
            flags += ["--read-only", "--read-only-tmpfs=false"]
        if context.get("allowPrivilegeEscalation") is False:
            flags += ["--security-opt", "no-new-privileges"]
        capabilities = context.get("capabilities", {})
        for dropped in capabilities.get("drop", []):
            flags += ["--cap-drop", dropped.lower()]
        for added in capabilities.get("add", []):
            flags += ["--cap-add", added.lower()]

        for key, value in _env(container).items():
            flags += ["--env", f"{key}={value}"]
        for mount in container.get("volumeMounts", []):
            if set(mount) - {"name", "mountPath", "readOnly"}:
                raise PodError(f"volumeMount {mount}: teach pod.py")
            spec = f"{self.volume_path(mount['name'])}:{mount['mountPath']}"
            flags += ["--volume", spec + (":ro" if mount.get("readOnly") else "")]

        limits = container.get("resources", {}).get("limits", {})
        if "memory" in limits:
            flags += ["--memory", str(int(_quantity(limits["memory"])))]
        if "cpu" in limits:
            flags += ["--cpus", f"{_quantity(limits['cpu']):g}"]
        if "command" in container:
            # Kubernetes: command replaces the entrypoint and drops the image's CMD.
            flags += ["--entrypoint", json.dumps(container["command"])]
        return flags

    def _argv(self, container: dict[str, Any]) -> list[str]:
        return [*self.run_args(container), self.image, *container.get("args", [])]

    def run_to_completion(self, container: dict[str, Any], timeout: float = 120) -> str:
        """Runs ``container`` (an init container) to its end; returns its output.

        Raises:
            AssertionError: it exited non-zero, as a failed init container would stop the pod.
        """
        name = f"{self.netns}-{container['name']}-{uuid.uuid4().hex[:6]}"
        self.containers.append(name)
        done = podman("run", "--name", name, *self._argv(container), timeout=timeout, check=False)
        podman("rm", "--force", "--volumes", name, timeout=60, check=False)
        assert done.returncode == 0, (
            f"container {container['name']} exited {done.returncode}:\n{done.stdout}{done.stderr}"
        )
        return done.stdout

    def start(self, container: dict[str, Any]) -> str:
        """Starts ``container`` detached; returns the podman container's name."""
        name = f"{self.netns}-{container['name']}-{uuid.uuid4().hex[:6]}"
        self.containers.append(name)
        podman("run", "--detach", "--name", name, *self._argv(container))
        return name

    def start_plain(self, volumes: dict[Path, str]) -> str:
        """Starts the image as it is (its user, entrypoint and environment) in this
        pod's network, with ``volumes`` (host directory: container path) bind-mounted."""
        name = f"{self.netns}-plain-{uuid.uuid4().hex[:6]}"
        self.containers.append(name)
        mounts = [f"--volume={host}:{path}" for host, path in volumes.items()]
        network = ["--network", f"ns:{self.netns_path}", "--pull", "never"]
        podman("run", "--detach", "--name", name, *network, *_limits(), *mounts, self.image)
        return name

    def start_sidecar(self) -> str:
        """What the kubelet does for the sidecar: the sidecar image's init containers
        in order, then the native sidecar, until its startup probe succeeds."""
        sidecar = _sidecar()
        for init in self.spec.get("initContainers", []):
            if init is sidecar:
                break
            if init["image"] == sidecar["image"]:
                self.run_to_completion(init)
        name = self.start(sidecar)
        result = self.probe(sidecar["startupProbe"])
        assert result["status"] == "SERVING", f"startup probe: {result}\n{self.logs(name)}"
        return name

    # --- inside the pod's network -----------------------------------------------

    def in_network(self, *argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """``argv`` on the host, in the pod's network namespace."""
        return _run(["nsenter", f"--net={self.netns_path}", "--", *argv], timeout, check=False)

    def probe(self, probe: dict[str, Any], host: str = POD_IP) -> dict[str, Any]:
        """The kubelet's gRPC ``probe`` against the pod's address (or ``host`` in the
        pod's network); its last outcome."""
        if set(probe) - {"grpc", "periodSeconds", "failureThreshold", "timeoutSeconds"}:
            raise PodError(f"probe {probe}: only gRPC probes run here")
        period = float(probe.get("periodSeconds", 10))
        failures = int(probe.get("failureThreshold", 3))
        timeout = float(probe.get("timeoutSeconds", 1))
        done = self.in_network(
            sys.executable,
            str(PROBE),
            "grpc",
            f"{host}:{probe['grpc']['port']}",
            probe["grpc"].get("service", ""),
            "--period",
            str(period),
            "--failure-threshold",
            str(failures),
            "--timeout",
            str(timeout),
            timeout=failures * (period + timeout) + 30,
        )
        assert done.stdout, done.stderr
        return dict(json.loads(done.stdout))

    def http_get(self, port: int, path: str) -> dict[str, Any]:
        """``GET http://POD_IP:port/path`` from inside the pod's network (a scrape)."""
        done = self.in_network(
            sys.executable,
            str(PROBE),
            "http",
            f"http://{POD_IP}:{port}{path}",
            "--timeout",
            "5",
            timeout=30,
        )
        assert done.stdout, done.stderr
        return dict(json.loads(done.stdout))

    # --- the containers' ends ---------------------------------------------------

    def logs(self, name: str) -> str:
        done = podman("logs", name, check=False)
        return done.stdout + done.stderr

    def stop(self, name: str, grace: float) -> tuple[int, float]:
        """SIGTERM, then SIGKILL after ``grace`` seconds (the kubelet's stop);
        returns the exit status and the seconds the stop took."""
        started = time.monotonic()
        podman("stop", "--time", str(int(grace)), name, timeout=grace + 60)
        elapsed = time.monotonic() - started
        code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        return int(code), elapsed

    def close(self) -> None:
        for name in self.containers:
            podman("rm", "--force", "--volumes", "--time", "0", name, timeout=60, check=False)
        _run(["ip", "netns", "del", self.netns], 30, check=False)


def tools_missing() -> list[str]:
    """The host tools the pod needs that are not on PATH."""
    return [tool for tool in ("podman", "runc", "ip", "nsenter") if shutil.which(tool) is None]
