"""Compares two profile_holder.py pstats: per function, calls and own time per proposal.

Functions are matched by (path relative to the package root, line-less name), so the
before tree's /tmp copy and this tree's files line up.
Usage: python compare_profiles.py BEFORE.pstats AFTER.pstats PROPOSALS [TOP]
"""

from __future__ import annotations

import pstats
import re
import sys


def _key(path: str, name: str) -> str:
    path = re.sub(r"^.*?/(sidecar|moe_sidecar)/", "moe_sidecar/", path)
    path = re.sub(r"^.*/bench/", "bench/", path)
    path = re.sub(r"^.*/(site-packages|python3\.11)/", "", path)
    return f"{path}:{name}"


def _table(file: str) -> dict[str, tuple[int, float, float]]:
    stats = pstats.Stats(file).stats  # type: ignore[attr-defined]
    table: dict[str, tuple[int, float, float]] = {}
    for (path, _line, name), (_cc, calls, tottime, cumtime, _callers) in stats.items():
        key = _key(path, name)
        old = table.get(key, (0, 0.0, 0.0))
        table[key] = (old[0] + calls, old[1] + tottime, max(old[2], cumtime))
    return table


def main() -> int:
    before, after = _table(sys.argv[1]), _table(sys.argv[2])
    proposals = int(sys.argv[3])
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    rows = []
    for key in before.keys() | after.keys():
        b, a = before.get(key, (0, 0.0, 0.0)), after.get(key, (0, 0.0, 0.0))
        rows.append((a[1] - b[1], key, b, a))
    rows.sort(reverse=True)
    print(
        f"{'own us/prop before':>18} {'after':>7} {'delta':>7} | {'calls/prop before':>17} "
        f"{'after':>7} | {'cum us/prop before':>18} {'after':>7} | function"
    )
    per = 1e6 / proposals
    for _delta, key, b, a in rows[:top]:
        print(
            f"{b[1] * per:>18.2f} {a[1] * per:>7.2f} {(a[1] - b[1]) * per:>7.2f} | "
            f"{b[0] / proposals:>17.2f} {a[0] / proposals:>7.2f} | "
            f"{b[2] * per:>18.1f} {a[2] * per:>7.1f} | {key}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
