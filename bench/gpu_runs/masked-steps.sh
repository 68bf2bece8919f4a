# GPU (1 x H200): masked steps on the installed FlashInfer release's
# all-to-all, built with enable_rank_mask: 4 ranks sharing the GPU step twice
# with every rank, rank 3 is SIGKILLed, ranks 0-2 run 20 steps under the mask
# without it (DeepSeek-V3's hidden 7168, bf16, top_k 8, 256 experts), every
# combine compared exactly with the CPU's expected value
# (bench/masked_steps_gpu.py). The argument picks the release:
#   bash bench/gpu_runs/masked-steps.sh 0721   (FlashInfer 0.7.2.post1, .gpu carried, $OUT set)
#   bash bench/gpu_runs/masked-steps.sh 074    (FlashInfer 0.7.4, .gpu074 carried, $OUT set)
case "${1:-}" in
  0721) . bench/gpu_runs/common.sh ;;
  074) . bench/gpu_runs/common-fi074.sh ;;
  *) echo "usage: bash bench/gpu_runs/masked-steps.sh 0721|074 (the FlashInfer release: 0.7.2.post1 or 0.7.4)" >&2; exit 2 ;;
esac
mkdir -p "$OUT/masked-steps-$1"
timeout 300 python3 bench/masked_steps_gpu.py --ranks 4 --steps 20 --watchdog 240 --out "$OUT/masked-steps-$1" 2>&1 | tee "$OUT/masked-steps-$1.log"
exit "${PIPESTATUS[0]}"
