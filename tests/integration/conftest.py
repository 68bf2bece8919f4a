"""Fixtures of the integration tests: a real etcd (see tests/etcd_server.py)."""

from __future__ import annotations

from tests.etcd_server import etcd_factory, etcd_server

__all__ = ["etcd_factory", "etcd_server"]
