"""``bench/bench_model_init.py``'s summary of py-spy samples: each sample counts
once, for the innermost frame of a known kind, and the shares add up."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_model_init import summarize_samples

pytestmark = pytest.mark.timeout(30)

LOOP = "run_forever (asyncio/base_events.py:607);_run_once (asyncio/base_events.py:1922)"
SESSION = "CoordinatorServicer.Session (sidecar/servicer.py:250)"


@pytest.mark.parametrize(
    ("stack", "kind"),
    [
        # grpc.aio's compiled callbacks: no Python frame below the loop's Handle._run.
        (f"{LOOP};Handle._run (asyncio/events.py:80)", "gRPC's compiled code"),
        # Below the servicer, the core is the innermost known frame.
        (
            f"{LOOP};Handle._run (asyncio/events.py:80);{SESSION};propose (sidecar/core/policy/propose.py:312)",
            "decision core",
        ),
        (f"{LOOP};Handle._run (asyncio/events.py:80);{SESSION}", "wire codec and servicer"),
        (
            f"{LOOP};Handle._run (asyncio/events.py:80);{SESSION};StateStore.save (sidecar/store/sqlite.py:229)",
            "store (SQLite",
        ),
        (f"{LOOP};EpollSelector.select (selectors.py:468)", "event loop polling"),
        ("_bootstrap (threading.py:1002);Thread.run (threading.py:982)", "other threads"),
        ("main (somewhere.py:1)", "other"),
    ],
)
def test_a_sample_counts_for_its_innermost_known_frame(
    tmp_path: Path, stack: str, kind: str
) -> None:
    folded = tmp_path / "folded.txt"
    folded.write_text(f"{stack} 7\n")
    lines = summarize_samples(folded).splitlines()
    assert lines[0].endswith("busy samples (py-spy, 1 kHz): 7; by the innermost frame's kind:")
    counted = [line for line in lines[1:] if line.split()[-2] == "7"]
    assert len(counted) == 1 and counted[0].strip().startswith(kind), lines


def test_shares_of_several_samples_add_up(tmp_path: Path) -> None:
    folded = tmp_path / "folded.txt"
    folded.write_text(
        f"{LOOP};Handle._run (asyncio/events.py:80) 3\n"
        f"{LOOP};Handle._run (asyncio/events.py:80);{SESSION} 1\n"
        "not a sample line\n"
    )
    lines = summarize_samples(folded).splitlines()
    assert "samples (py-spy, 1 kHz): 4;" in lines[0]
    assert lines[1].split()[-2:] == ["3", "75.0%"]
    assert lines[2].split()[-2:] == ["1", "25.0%"]
    assert sum(int(line.split()[-2]) for line in lines[1:]) == 4
