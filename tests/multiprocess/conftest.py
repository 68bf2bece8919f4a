"""Fixtures of the multi-process tests: a real sidecar per test, a real etcd."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_server import etcd_factory, etcd_server
from tests.multiprocess.harness import Sidecar, running_sidecar

__all__ = ["etcd_factory", "etcd_server", "sidecar"]


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    """A real sidecar on a Unix socket in ``tmp_path`` (20 s round timeout)."""
    with running_sidecar(tmp_path / "sidecar", round_timeout=20.0) as running:
        yield running
