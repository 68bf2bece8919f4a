"""The vLLM room's pure rules, no vLLM needed: which FlashInfer release a vLLM
release is served on (checked at plugin load), and what vLLM 0.34's
``update_mask`` may ask of the committed view."""

from __future__ import annotations

import pytest

from moe_sidecar.client.engines.vllm.fault_tolerance import check_update_mask
from moe_sidecar.client.engines.vllm.releases import UnsupportedReleases, check_releases
from moe_sidecar.core.errors import InvalidArgument, PreconditionFailed
from moe_sidecar.flashinfer import RELEASES

pytestmark = pytest.mark.timeout(30)

MOE_ALLTOALL, MOE_EP = RELEASES[0], RELEASES[-1]


@pytest.mark.parametrize(
    ("vllm", "flashinfer", "row"),
    [
        ("0.33.0", MOE_ALLTOALL.name, MOE_ALLTOALL),
        ("0.33.0", MOE_EP.name, MOE_EP),
        ("0.34.0", MOE_EP.name, MOE_EP),
        ("0.34.0", None, None),
    ],
)
def test_served_pairs(vllm: str, flashinfer: str | None, row: object) -> None:
    found = check_releases(vllm, flashinfer)
    assert found.release is row and found.vllm == vllm
    assert (flashinfer or "not installed") in found.describe()


def test_vllm_0_34_on_the_moe_alltoall_release_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedReleases) as refused:
        check_releases("0.34.0", MOE_ALLTOALL.name)
    message = str(refused.value)
    assert f"vLLM 0.34.0 with FlashInfer {MOE_ALLTOALL.name}" in message
    assert "runtime_max_tokens_per_rank" in message
    assert f"pip install '.[{MOE_EP.install_extra}]'" in message


@pytest.mark.parametrize("vllm", ["0.33.0", "0.34.0"])
def test_a_flashinfer_release_without_a_row_is_refused_not_served_by_another(vllm: str) -> None:
    between = "0.7.3"  # vLLM 0.34's pin: between the rows, in no row
    assert all(between not in r.versions for r in RELEASES)
    with pytest.raises(UnsupportedReleases) as refused:
        check_releases(vllm, between)
    message = str(refused.value)
    assert f"vLLM {vllm} with FlashInfer {between}" in message
    assert "has no row of its release table" in message
    if vllm == "0.34.0":
        assert f"flashinfer-python=={MOE_EP.name}" in message


def test_update_mask_accepts_a_rank_the_view_excludes() -> None:
    check_update_mask("g", 3, True, 4, (2, (0, 1, 2)))


@pytest.mark.parametrize(
    ("rank", "masked", "view", "error", "words"),
    [
        (2, True, (2, (0, 1, 2)), PreconditionFailed, ("EP rank 2 dead", "view 2", "[0, 1, 2]")),
        (3, False, (2, (0, 1, 2)), PreconditionFailed, ("masked=False", "rejoin()")),
        (3, True, None, PreconditionFailed, ("no membership view is adopted",)),
        (4, True, (2, (0, 1, 2)), InvalidArgument, ("rank=4", "[0, 4)")),
        (3, 1, (2, (0, 1, 2)), InvalidArgument, ("masked=1",)),
    ],
)
def test_update_mask_refuses_by_name(
    rank: int,
    masked: object,
    view: tuple[int, tuple[int, ...]] | None,
    error: type,
    words: tuple[str, ...],
) -> None:
    with pytest.raises(error) as refused:
        check_update_mask("g", rank, masked, 4, view)
    for word in words:
        assert word in str(refused.value), refused.value
