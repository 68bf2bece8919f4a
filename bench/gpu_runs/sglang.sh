# GPU run for SGLang (one H200; EP ranks share it): the adapter's namespaces
# built at DeepSeek-V3 shapes (NVFP4 target + bf16 MTP draft) on FlashInfer
# 0.7.2.post1, SGLang's call form of dispatch + combine checked exactly, and
# device memory per rank beside FlashInfer's MoeAlltoAll at SGLang's own sizes,
# in the same run. SGLang itself does not travel (docs/sglang.md says why).
#   bash bench/gpu_runs/sglang.sh      (on the GPU machine, .gpu carried, $OUT set)
. bench/gpu_runs/common.sh
for ep in 2 8; do
  timeout 280 python3 bench/gpu_runs/sglang_alltoall.py --ep "$ep" --tokens 4096 --out "$OUT" \
    2>&1 | tee "$OUT/sglang-ep$ep.log"
done
