#!/usr/bin/env bash
# The bench's "state holder at 8 ranks" line, 3 interleaved runs per tree:
#   prefix: this branch before the next_deadline fix (git archive bfe85d1^ into /tmp/prefix-tree)
#   fix:    this worktree (the editable install)
# The order alternates per run. The archived tree is imported through a directory of links named as
# pyproject's package-dir maps them (moe_sidecar -> sidecar, moe_workspace -> proto/moe_workspace).
set -u
cd "$(git rev-parse --show-toplevel)"
for run in 1 2 3; do
  order="prefix fix"; [ $((run % 2)) -eq 0 ] && order="fix prefix"
  for tree in $order; do
    case $tree in
      fix) line=$(python bench/bench_sidecar.py --quick | grep "state holder at 8 ranks") ;;
      *) line=$(cd /tmp/$tree-tree && PYTHONPATH=/tmp/$tree-pkgs python bench/bench_sidecar.py --quick \
                | grep "state holder at 8 ranks") ;;
    esac
    echo "run $run $tree: $line"
  done
done
