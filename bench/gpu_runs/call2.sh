# GPU call 2 (2 x H200): the cold start measured four ways (bench/gpu_cold_start.py,
# one cold JIT compile inside), device memory of our manager vs vLLM 0.33's own
# sequence (bench/vllm_gpu_bench.py), and the build/round/exchange timings
# (bench/gpu_bench.py). FlashInfer's module compiled in call 1 is carried as
# .gpu/aot (the cold case hides it).
#   bash bench/gpu_runs/call2.sh      (on the GPU machine, .gpu carried, $OUT set)
. bench/gpu_runs/common.sh
timeout 330 python3 bench/gpu_cold_start.py --out "$OUT" 2>&1 | tee "$OUT/cold-start-console.log"
timeout 120 python3 bench/vllm_gpu_bench.py --out "$OUT" 2>&1 | tee "$OUT/vllm-bench.log"
timeout 130 python3 bench/gpu_bench.py 2>&1 | tee "$OUT/gpu-bench.log"
