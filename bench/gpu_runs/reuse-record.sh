# The GPU host's 16 cores (one H200 machine; no GPU is used): what recording
# every REUSE round before its answer costs. Run once in a checkout of the
# branch before the change and once in this one, then compare the lines
# "what a round's answer commits first", "state holder at 8 ranks" and
# "covered layer through the sidecar" between the two runs.
#   bash bench/gpu_runs/reuse-record.sh      (on the GPU machine, .gpu carried, $OUT set)
. bench/gpu_runs/common.sh
timeout 280 python3 bench/bench_sidecar.py --quick 2>&1 | tee "$OUT/bench-sidecar.log"
timeout 280 python3 bench/bench_model_init.py --repeats 3 2>&1 | tee "$OUT/bench-model-init.log"
