# The GPU host's 16 cores (one H200 machine; no GPU is used): the sidecar and
# model-init benches on the tree before REUSE rounds were recorded before
# their answer (the parent of the commit that made that choice, carried as
# .gpu/before.tar: `git archive <commit>^ > .gpu/before.tar`) and on this
# tree, one after the other on the same machine, so their lines compare:
# "state holder at 8 ranks" (bench_sidecar) and "covered layer through the
# sidecar" (bench_model_init).
#   bash bench/gpu_runs/reuse-before-after.sh   (on the GPU machine, .gpu carried, $OUT set)
# RUNS (default 3) sets the rounds; CPUS (e.g. 0,1) pins every bench to those
# cores with taskset (its sidecar and rank processes inherit it), for the
# figures of a 2-core machine; TAG names the archive (reuse-before-after$TAG.tgz).
. bench/gpu_runs/common.sh
mkdir -p /tmp/before && tar xf .gpu/before.tar -C /tmp/before || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site-before /tmp/before || exit 1
# Three rounds, the order alternating, since each bench leaves the load
# average high for the next one.
pin=${CPUS:+taskset -c $CPUS}
for run in $(seq 1 "${RUNS:-3}"); do
 for tree in $([ $((run % 2)) = 1 ] && echo before after || echo after before); do
  if [ "$tree" = before ]; then dir=/tmp/before path=/tmp/site-before:/tmp/site:/tmp/before; else dir=$PWD path=$PYTHONPATH; fi
  (cd "$dir" && PYTHONPATH=$path timeout 150 $pin python3 bench/bench_sidecar.py --quick) >"$OUT/bench-sidecar-$tree-$run.log" 2>&1
  (cd "$dir" && PYTHONPATH=$path timeout 100 $pin python3 bench/bench_model_init.py --repeats 3) >"$OUT/bench-model-init-$tree-$run.log" 2>&1
 done
done
for f in "$OUT"/bench-*.log; do echo "== $f"; grep -E "state holder at 8|covered layer through|commits first|^# bench" "$f"; done
tar czf "$OUT/reuse-before-after${TAG:-}.tgz" -C "$OUT" $(cd "$OUT" && ls bench-*.log machine.txt) && rm "$OUT"/bench-*.log
