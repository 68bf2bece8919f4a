"""The room of FlashInfer releases: its table, its lookups, each row's facts. Table-driven, no I/O.

The byte-for-byte parity of each release's arithmetic with FlashInfer's own
is checked elsewhere: 0.7.2.post1's in ``tests/unit/test_sizing.py`` (and
on the GPU, ``tests/gpu/test_sizing_parity.py``), 0.7.4's against
``tests/data/flashinfer-0.7.4-layouts.csv`` in ``tests/unit/test_sizing_moe_ep.py``.
Here: that every row is wired to its module's arithmetic and limits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from moe_sidecar import flashinfer
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.plan import Capacities, join_capacities
from moe_sidecar.flashinfer import v0_7_2_post1, v0_7_4

pytestmark = pytest.mark.timeout(10)

OLD, NEW = v0_7_2_post1.RELEASE, v0_7_4.RELEASE


def test_the_table_lists_each_release_once_oldest_first() -> None:
    assert flashinfer.RELEASES == (OLD, NEW)
    assert flashinfer.DEFAULT_RELEASE is OLD
    assert len({r.name for r in flashinfer.RELEASES}) == len(flashinfer.RELEASES)
    assert [r.release_number for r in flashinfer.RELEASES] == sorted(
        r.release_number for r in flashinfer.RELEASES
    )


@dataclass(frozen=True)
class Row:
    release: flashinfer.Release
    name: str
    versions: tuple[str, ...]
    backend: str
    max_ranks: int
    module: str
    sources: int


ROWS = [
    Row(OLD, "0.7.2.post1", ("0.7.2", "0.7.2.post1"), "flashinfer-moe-alltoall", 64,
        "mnnvl_moe_alltoall", 1),
    Row(NEW, "0.7.4", ("0.7.4",), "flashinfer-moe-ep", 256, "nvlink_one_sided_alltoall", 2),
]  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_each_row_holds_its_releases_facts(row: Row) -> None:
    r = row.release
    assert (r.name, r.versions, r.backend, r.max_ranks) == (
        row.name,
        row.versions,
        row.backend,
        row.max_ranks,
    )
    assert r.max_top_k == 22 and max(r.supported_top_k) == 22
    assert r.jit_module.name == row.module and len(r.jit_module.sources) == row.sources
    assert r.jit_module.spec_factory.startswith("flashinfer.jit.comm:gen_")
    assert set(r.dispatch_format_bytes) >= {"BF16", "FP8PerTensor", "MXFP8", "NVFP4", "MXFP4"}


@pytest.mark.parametrize(
    ("name", "found"),
    [("", OLD), ("0.7.2.post1", OLD), ("0.7.4", NEW)],
)
def test_a_name_finds_its_row_and_empty_is_the_default(
    name: str, found: flashinfer.Release
) -> None:
    assert flashinfer.release_named(name) is found
    assert flashinfer.check_release_name("flashinfer_release", name) == found.name


@pytest.mark.parametrize("name", ["0.7.2", "0.7.3", "nightly", "0.7.4 "])
def test_any_other_name_is_refused_naming_the_field_and_the_known_ones(name: str) -> None:
    with pytest.raises(LookupError, match=re.escape("0.7.2.post1, 0.7.4")):
        flashinfer.release_named(name)
    with pytest.raises(InvalidArgument) as caught:
        flashinfer.check_release_name("flashinfer_release", name)
    assert caught.value.field == "flashinfer_release" and caught.value.value == name


@pytest.mark.parametrize(
    ("version", "exact", "serving"),
    [
        ("0.7.2", OLD, OLD),  # the all-to-all files are byte-identical
        ("0.7.2.post1", OLD, OLD),
        ("0.7.4", NEW, NEW),
        ("0.6.18.post1", None, OLD),  # older: MoeAlltoAll's API
        ("0.7.3", None, OLD),
        ("0.7.5", None, NEW),  # newer: moe_ep's API
        ("0.8.0rc1", None, NEW),
    ],
)
def test_an_installed_version_finds_the_row_that_serves_it(
    version: str, exact: flashinfer.Release | None, serving: flashinfer.Release
) -> None:
    assert flashinfer.release_for_version(version) is exact
    assert flashinfer.release_serving(version) is serving


def test_a_version_without_a_release_number_is_refused() -> None:
    with pytest.raises(ValueError, match="'nightly': not a release number"):
        flashinfer.release_serving("nightly")


NVFP4 = Capacities(128, 7168 // 2 + 7168 // 16 + 64, 2 * 7168, 8, 256)
BF16 = Capacities(128, 2 * 7168 + 64, 2 * 7168, 8, 256)


@pytest.mark.parametrize("ep_size", [1, 2, 8, 64])
@pytest.mark.parametrize("capacities", [NVFP4, BF16, join_capacities(NVFP4, BF16)])
def test_the_size_function_is_each_releases_own_arithmetic(
    ep_size: int, capacities: Capacities
) -> None:
    c = capacities
    old = v0_7_2_post1.workspace_size_per_rank(
        ep_size, c.max_tokens, c.dispatch_bytes_per_token, c.combine_bytes_per_token
    )
    new = v0_7_4.capacities_workspace_bytes(c, ep_size)
    assert flashinfer.workspace_size(OLD.name, c, ep_size) == old == OLD.workspace_bytes(c, ep_size)
    assert flashinfer.workspace_size(NEW.name, c, ep_size) == new == NEW.workspace_bytes(c, ep_size)
    assert flashinfer.workspace_size("", c, ep_size) == old
    # The releases lay these out differently (0.7.4 sizes the top-k regions by top_k).
    assert old != new


def test_the_deepseek_v3_figures_of_the_design() -> None:
    # DESIGN section 9: EP 2, 128 tokens on 0.7.2.post1; EP 8, 8,192 tokens on 0.7.4.
    assert OLD.workspace_bytes(NVFP4, 2) == 4_741_504
    assert OLD.workspace_bytes(join_capacities(NVFP4, BF16), 2) == 7_379_328
    wide = Capacities(8192, NVFP4.dispatch_bytes_per_token, 2 * 7168, 8, 256)
    assert NEW.workspace_bytes(wide, 8) == 1_208_485_376
    both = Capacities(8192, BF16.dispatch_bytes_per_token, 2 * 7168, 8, 256)
    assert NEW.workspace_bytes(both, 8) == 1_883_768_320


@pytest.mark.parametrize(
    ("release", "args", "reasons"),
    [
        (OLD, (8, 8, 256, 0), ()),
        (OLD, (8, 8, 250, 0), ("num_experts=250 is not divisible by the EP size 8",)),
        (NEW, (8, 8, 256, 0), ()),
        (NEW, (8, 5, 256, 0), ("top_k=5: NVLinkOneSidedAlltoAll supports top_k in",)),
        (NEW, (8, 8, 256, 300), ("eplb_stats_num_experts=300 must be in [0, num_experts=256]",)),
    ],
)
def test_each_release_says_what_its_objects_refuse(
    release: flashinfer.Release, args: tuple[int, int, int, int], reasons: tuple[str, ...]
) -> None:
    found = release.object_refusals(*args)
    assert len(found) == len(reasons)
    for got, want in zip(found, reasons, strict=True):
        assert got.startswith(want)


@pytest.mark.parametrize("release", flashinfer.RELEASES, ids=lambda r: r.name)
def test_a_format_a_release_does_not_dispatch_is_refused_naming_it(
    release: flashinfer.Release,
) -> None:
    assert release.format_bytes("NVFP4", 7168) == 7168 // 2 + 7168 // 16
    with pytest.raises(flashinfer.LayoutError, match="dispatch_format='INT4'"):
        release.format_bytes("INT4", 7168)
