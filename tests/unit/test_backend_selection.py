"""Which FlashInfer backend ``"flashinfer"`` means, from the release installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from moe_sidecar.client.backends import BACKENDS, flashinfer_backend_name

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("version", "backend"),
    [
        ("0.6.18.post1", "flashinfer-moe-alltoall"),
        ("0.7.2.post1", "flashinfer-moe-alltoall"),
        ("0.7.3", "flashinfer-moe-alltoall"),
        ("0.7.4", "flashinfer-moe-ep"),
        ("0.7.4rc1", "flashinfer-moe-ep"),
        ("0.8.0", "flashinfer-moe-ep"),
        ("1.0.0.dev3", "flashinfer-moe-ep"),
    ],
)
def test_release_to_backend(version: str, backend: str) -> None:
    assert flashinfer_backend_name(version) == backend
    assert backend in BACKENDS


def test_a_version_without_a_release_number_is_refused() -> None:
    with pytest.raises(ValueError, match="'nightly'"):
        flashinfer_backend_name("nightly")


def test_the_installed_release() -> None:
    expected = (
        "flashinfer-moe-alltoall"
        if importlib.util.find_spec("flashinfer") is None
        else flashinfer_backend_name(importlib.metadata.version("flashinfer-python"))
    )
    assert flashinfer_backend_name() == expected
