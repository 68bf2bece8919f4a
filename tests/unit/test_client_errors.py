"""gRPC status -> typed error, on errors raised by a real gRPC server.

A tiny in-process server aborts each call with the status code named in the
request, so every RpcError here is a real one from the gRPC runtime.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from moe_sidecar.client import errors
from moe_sidecar.client.errors import error_from_rpc, rpc_status

pytestmark = pytest.mark.timeout(30)

_METHOD = "/test.Abort/Code"


def _abort(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.abort(grpc.StatusCode[request.decode()], f"server says {request.decode()}")
    raise AssertionError("abort returned")


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler(
        "test.Abort", {"Code": grpc.unary_unary_rpc_method_handler(_abort)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
        yield chan
    server.stop(grace=None)


def _rpc_error(channel: grpc.Channel, code: str) -> grpc.RpcError:
    call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(_METHOD)
    with pytest.raises(grpc.RpcError) as caught:
        call(code.encode(), timeout=10)
    return caught.value


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("INVALID_ARGUMENT", errors.InvalidArgument),
        ("NOT_FOUND", errors.GroupNotFound),
        ("FAILED_PRECONDITION", errors.PreconditionFailed),
        ("DEADLINE_EXCEEDED", errors.RoundTimedOut),
        ("ABORTED", errors.RoundAborted),
        ("UNAVAILABLE", errors.CoordinatorUnavailable),
        ("PERMISSION_DENIED", errors.PermissionDenied),
        ("INTERNAL", errors.InternalError),
        ("CANCELLED", errors.CoordinatorUnavailable),
        ("UNIMPLEMENTED", errors.InternalError),
        ("RESOURCE_EXHAUSTED", errors.ResourceExhausted),
    ],
)
def test_status_maps_to_typed_error(
    channel: grpc.Channel, code: str, expected: type[errors.CoordinatorError]
) -> None:
    rpc_error = _rpc_error(channel, code)
    typed = error_from_rpc(rpc_error, method="Propose", target="unix:///s.sock")
    assert type(typed) is expected
    assert f"server says {code}" in typed.message
    try:
        raise typed from rpc_error
    except errors.CoordinatorError as raised:
        status = rpc_status(raised)
        assert status is not None
        assert status.code is grpc.StatusCode[code]
        assert status.details == f"server says {code}"


def test_sidecar_messages_pass_through_unchanged(channel: grpc.Channel) -> None:
    typed = error_from_rpc(_rpc_error(channel, "FAILED_PRECONDITION"), method="Propose", target="x")
    # Same text as in embedded mode, where no gRPC is involved.
    assert typed.message == "server says FAILED_PRECONDITION"


def test_transport_failures_name_method_and_target(channel: grpc.Channel) -> None:
    typed = error_from_rpc(_rpc_error(channel, "UNAVAILABLE"), method="Commit", target="t:1")
    assert typed.message.startswith("Commit to sidecar t:1: UNAVAILABLE")
    odd = error_from_rpc(_rpc_error(channel, "DATA_LOSS"), method="Propose", target="t:1")
    assert "unexpected status DATA_LOSS" in odd.message
    health = error_from_rpc(_rpc_error(channel, "UNIMPLEMENTED"), method="Propose", target="t:1")
    assert "t:1 is the sidecar's health port" in health.message


def test_errors_of_embedded_mode_have_no_rpc_status() -> None:
    assert rpc_status(errors.PreconditionFailed("local")) is None


def test_agreement_error_is_a_precondition_failure() -> None:
    error = errors.AgreementError("ranks disagree", (errors.RankFailure(1, "mtp", "top_k=4"),))
    assert isinstance(error, errors.PreconditionFailed)
    assert error.code is errors.ErrorCode.FAILED_PRECONDITION
    assert error.failures[0].ep_rank == 1
