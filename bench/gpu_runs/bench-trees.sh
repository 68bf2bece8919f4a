# The GPU host's 16 cores (no GPU used): bench_sidecar --quick on several
# trees, carried as .gpu/<name>.tar (`git archive <commit> > .gpu/<name>.tar`),
# and on this one ("this"), in rounds whose order rotates, so that the load one
# run leaves behind falls on each tree in turn.
#   bash bench/gpu_runs/bench-trees.sh NAME... (on the GPU machine, .gpu carried, $OUT set)
. bench/gpu_runs/common.sh
trees="$* this"
for name in "$@"; do
  mkdir -p "/tmp/tree-$name" && tar xf ".gpu/$name.tar" -C "/tmp/tree-$name" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "/tmp/site-$name" "/tmp/tree-$name" 2>/dev/null || exit 1
done
for run in 1 2 3; do
  for name in $trees; do
    if [ "$name" = this ]; then dir=$PWD path=$PYTHONPATH; else dir=/tmp/tree-$name path=/tmp/site-$name:/tmp/site:/tmp/tree-$name; fi
    (cd "$dir" && PYTHONPATH=$path timeout 100 python3 bench/bench_sidecar.py --quick) >"$OUT/bench-sidecar-$name-$run.log" 2>&1
  done
  trees="$(echo $trees | cut -d' ' -f2-) $(echo $trees | cut -d' ' -f1)"
done
for f in "$OUT"/bench-*.log; do echo "== $f"; grep -E "^# bench|commits first" "$f"; grep -A4 "in-process state holder" "$f" | tail -3; done
tar czf "$OUT/bench-trees.tgz" -C "$OUT" $(cd "$OUT" && ls bench-*.log machine.txt) && rm "$OUT"/bench-*.log
