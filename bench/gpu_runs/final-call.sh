# GPU call (1 x H200, FlashInfer 0.7.2.post1, .gpu carried with .gpu/before.tar):
# final-0721.sh's three parts on cores 2-15 and, at the same time on cores 0
# and 1, reuse-before-after.sh's benches on the two trees (one round each:
# the figures of a 2-core machine; no GPU used by them).
#   bash bench/gpu_runs/final-call.sh      (on the GPU machine, $OUT set)
. bench/gpu_runs/common.sh
(CPUS=0,1 RUNS=1 TAG=-2core bash bench/gpu_runs/reuse-before-after.sh >"$OUT/reuse-2core.log" 2>&1) &
PART_CPUS=2-15 bash bench/gpu_runs/final-0721.sh
wait
echo "== reuse on 2 cores"; cat "$OUT/reuse-2core.log"
