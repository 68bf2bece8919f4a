# The inference image of docker/k8s/inference-daemonset.yaml: vLLM with
# moe-sidecar's plugin. The [vllm] extra adds what the manager needs and
# leaves vLLM's own torch and FlashInfer alone; its vllm.general_plugins entry
# point replaces vLLM's FlashInferNVLinkOneSidedManager in every worker when
# MOE_SIDECAR_TARGET is set (the pod sets it). Build from anywhere (it copies
# nothing): docker build -f docker/inference.Dockerfile -t <registry>/vllm-moe-sidecar:0.33.0 .
FROM vllm/vllm-openai:v0.33.0
RUN pip install 'moe-sidecar[vllm]'
