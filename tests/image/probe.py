"""The kubelet's probes and a Prometheus scrape, run inside the pod's network namespace.

``tests/image/pod.py`` starts this file under ``nsenter --net=<the pod's
namespace>`` with the test's own Python, so it dials the pod's address the way
the kubelet and Prometheus dial a pod IP, without any network outside the
namespace. It prints one JSON line and exits 0 on success, 1 otherwise:

    probe.py grpc ADDRESS SERVICE --period S --failure-threshold N --timeout S
    probe.py http URL --timeout S

``grpc`` is the kubelet's gRPC probe: up to ``failure-threshold`` attempts,
``period`` seconds apart, each a ``grpc.health.v1.Health/Check`` for
``SERVICE`` with a deadline of ``timeout`` seconds; success is SERVING.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _grpc_probe(address: str, service: str, period: float, failures: int, timeout: float) -> int:
    last = ""
    for attempt in range(1, failures + 1):
        try:
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout
                )
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else None
            last = code.name if code is not None else str(error)
        if last == "SERVING":
            print(json.dumps({"status": last, "attempts": attempt}))
            return 0
        if attempt < failures:
            time.sleep(period)  # the probe's period, as the kubelet waits it
    print(json.dumps({"status": last, "attempts": failures}))
    return 1


def _http_get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            body = reply.read().decode()
            print(json.dumps({"status": reply.status, "body": body}))
            return 0
    except OSError as error:
        print(json.dumps({"status": None, "error": str(error)}))
        return 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    probe = commands.add_parser("grpc")
    probe.add_argument("address")
    probe.add_argument("service")
    probe.add_argument("--period", type=float, required=True)
    probe.add_argument("--failure-threshold", type=int, required=True)
    probe.add_argument("--timeout", type=float, required=True)
    get = commands.add_parser("http")
    get.add_argument("url")
    get.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args(argv)
    if args.command == "grpc":
        return _grpc_probe(
            args.address, args.service, args.period, args.failure_threshold, args.timeout
        )
    return _http_get(args.url, args.timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
