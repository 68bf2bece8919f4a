# FlashInfer 0.7.4 GPU call 1 (one H200): tests/data/flashinfer-0.7.4-layouts.csv
# against the real op moe_a2a_get_workspace_layout and FlashInfer's own
# NVLinkOneSidedAlltoAll.__init__ (bench/gpu_runs/fi074_layouts.py), after the
# module's first compile.
#   bash bench/gpu_runs/prepare-fi074.sh        (here, once: .gpu074)
#   run: bash bench/gpu_runs/fi074-layouts.sh   (carry .gpu074; copy $OUT to bench/results/gpu/)
. bench/gpu_runs/common-fi074.sh
echo "command: python3 bench/gpu_runs/fi074_layouts.py --json \$OUT/fi074-layouts.json" | tee "$OUT/fi074-layouts.log"
timeout 560 python3 bench/gpu_runs/fi074_layouts.py --json "$OUT/fi074-layouts.json" 2>&1 | tee -a "$OUT/fi074-layouts.log" | tail -n 30
