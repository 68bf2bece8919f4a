"""The metrics reference (docs/operations.md) lists exactly what the sidecar exports
(with ``--store etcd://``, which adds the cluster store's series)."""

from __future__ import annotations

import importlib.metadata
import platform
import re

import pytest

from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.store.replica import StoreMetrics
from tests.dockerfile import REPO

pytestmark = pytest.mark.timeout(30)


def _documented() -> dict[str, tuple[str, set[str]]]:
    text = (REPO / "docs" / "operations.md").read_text()
    start = text.index("## Metrics reference")
    end = text.find("\n## ", start + 1)
    section = text[start:] if end < 0 else text[start:end]
    rows = re.findall(r"^\| `(moe_sidecar_\w+)` \| (\w+) \|([^|]*)\|", section, re.MULTILINE)
    return {name: (kind, set(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


def _exported() -> dict[str, tuple[str, set[str]]]:
    metrics = SidecarMetrics(limits={"groups": 1024})
    # One sample in every labelled family, so each shows its label names.
    series = metrics.group("g")
    series.round_closed("build")
    series.rebuilds.inc()
    series.set_sizes(1, 0)
    metrics.errors.labels("NOT_FOUND").inc()
    metrics.undecodable.labels(method="Propose").inc()
    metrics.refused("groups")
    metrics.round_latency.observe(0.001)
    metrics.groups.set(1)
    metrics.views.labels(state="proposed").inc()
    metrics.stream_cutoffs.labels(method="Watch", reason="overflow", connection="shut").inc()
    store = StoreMetrics(metrics.registry)  # registered with --store etcd:// only
    store.writes.labels("written").inc()
    exported = {}
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        exported[name] = (family.type, labels)
    return exported


def test_metrics_reference_matches_the_exported_series() -> None:
    documented = _documented()
    assert documented, "no metrics table in the README"
    assert documented == _exported()


def test_build_info_is_one_series_naming_the_release_and_python() -> None:
    metrics = SidecarMetrics()
    samples = [
        s
        for f in metrics.registry.collect()
        if f.name == "moe_sidecar_build_info"
        for s in f.samples
    ]
    assert [(s.labels, s.value) for s in samples] == [
        (
            {
                "version": importlib.metadata.version("moe-sidecar"),
                "python": platform.python_version(),
            },
            1.0,
        )
    ]
