# GPU (1 x H200): a replacement rank rejoins on the installed FlashInfer
# release's all-to-all, through the manager and a real sidecar
# (bench/rejoin_gpu.py): 4 ranks sharing the GPU under
# MOE_SIDECAR_ON_PEER_LOSS=mask step twice with every rank, rank 3 is
# SIGKILLed, ranks 0-2 adopt view 2 and run 20 masked steps, a replacement
# for rank 3 joins (every rank rebuilds once at the stored plan under the
# next generation, view 3 commits), and all 4 run 20 steps with every rank
# (DeepSeek-V3's hidden 7168, bf16, top_k 8, 256 experts; every combine
# compared exactly with the CPU's expected value). The argument picks the release:
#   bash bench/gpu_runs/rejoin.sh 0721   (FlashInfer 0.7.2.post1, .gpu carried, $OUT set)
#   bash bench/gpu_runs/rejoin.sh 074    (FlashInfer 0.7.4, .gpu074 carried, $OUT set;
#                                         its module compiles first unless /tmp/fi-074 holds it)
case "${1:-}" in
  0721) . bench/gpu_runs/common.sh ;;
  074) . bench/gpu_runs/common-fi074.sh ;;
  *) echo "usage: bash bench/gpu_runs/rejoin.sh 0721|074 (the FlashInfer release: 0.7.2.post1 or 0.7.4)" >&2; exit 2 ;;
esac
mkdir -p "$OUT/rejoin-$1"
timeout 400 python3 bench/rejoin_gpu.py --ranks 4 --steps 20 --watchdog 300 --out "$OUT/rejoin-$1" 2>&1 | tee "$OUT/rejoin-$1.log"
exit "${PIPESTATUS[0]}"
