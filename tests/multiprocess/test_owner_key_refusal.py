"""An owner key someone else could have chosen stops rank 0 at its first
``initialize()``: a typed error (``UnsafeOwnerKey``, a ``PermissionDenied``)
naming the path, what is wrong and the fix, raised before rank 0 arrives at
or proposes to the sidecar, so no plan is proposed with it. Real sidecar,
real rank processes (gloo), the reference backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiprocess import owner_key_workers
from tests.multiprocess.harness import Sidecar, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

GROUP = "owner-key/unsafe-directory"


def test_rank_0_with_a_key_directory_others_may_write_raises_before_any_proposal(
    tmp_path: Path,
) -> None:
    unsafe = tmp_path / "keys"
    unsafe.mkdir()
    unsafe.chmod(0o777)
    sidecar = Sidecar(tmp_path / "sidecar", round_timeout=3.0).start()
    try:
        refused, peer = run_ranks(
            owner_key_workers.first_initialize_worker,
            2,
            timeout=150,
            tmp_path=tmp_path / "ranks",
            args=(sidecar.target, GROUP),
            envs=[{"MOE_SIDECAR_KEY_DIR": str(unsafe)}, {}],
        )
        seen = sidecar.get_group(GROUP) if GROUP in sidecar.group_names() else None
    finally:
        sidecar.stop()
    assert refused["type"] == "UnsafeOwnerKey" and "PermissionDenied" in refused["mro"], refused
    assert refused["message"] == (
        f"owner key directory {unsafe}: has mode 777, writable by group or others; "
        f"chmod 700 {unsafe}"
    )
    assert not list(unsafe.iterdir())  # no key made there
    # Its peer builds nothing alone; the sidecar never had a proposal or an
    # arrival of rank 0, so no plan came of it.
    assert peer.get("ok") is not True, peer
    if seen is not None:
        assert not seen.HasField("plan") and seen.last_closed_round == 0, seen
        assert 0 not in seen.arrived_ranks and seen.waiting_ranks == 0, seen
