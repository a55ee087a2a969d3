#!/bin/bash
# The services on two GPUs, each service its own process (as deployed), 8B-shaped dummy target and EAGLE-1 head,
# SIMULATED acceptance: speculative vs plain tokens/s at 1-128 concurrent requests for each --speculation mode
# (docs/benchmarks.md, "GPU: H200, fourth pass"). Needs 2 GPUs and flashinfer. Run from the repository root:
#
#   bash bench/services_gpu.sh                 # tau 5 and 3, all modes (~5 min on 2 x H200)
#   TAUS=5 MODES="always" bash bench/services_gpu.sh
#   TINY=1 bash bench/services_gpu.sh          # then also the bundled tiny pair (real acceptance, both heads)
#   TAUS= TINY=1 bash bench/services_gpu.sh    # only the tiny pair (it needs the tiny weights on the machine)
#   REPEATS=2 MODES="auto --two-batch-overlap 32" bash bench/services_gpu.sh   # best of 2 (a trained policy)
#   MODES="off" bash bench/services_gpu.sh     # plain decoding through the draft service vs target Generate
#   DRAFT_CONFIG=llama3-8b-eagle3 bash bench/services_gpu.sh   # an EAGLE-3-shaped head instead of EAGLE-1
#
# Each row: | setting | N | spec tok/s | plain tok/s | speed-up | tau | steps | per-step ms ... | busy {gpu: fraction}
set -euo pipefail
TAUS=${TAUS-"5 3"}
MODES=${MODES:-"always|always --two-batch-overlap 32|auto --two-batch-overlap 32"}
CONCURRENCY=${CONCURRENCY:-1,8,32,64,128}
NEW_TOKENS=${NEW_TOKENS:-192}
REPEATS=${REPEATS:-1}  # best of N runs per row (2: the second with the policy the first trained)
DRAFT_CONFIG=${DRAFT_CONFIG:-llama3-8b-eagle1}  # or llama3-8b-eagle3 (32k draft vocabulary, 3 feature layers)
DRAFT="--load-format dummy --config $DRAFT_CONFIG --target-model llama3-8b"
IFS='|' read -r -a modes <<< "$MODES"
for tau in $TAUS; do
  for mode in "${modes[@]}"; do
    echo "== SIMULATED tau $tau, --speculation $mode"
    python bench/services_bench.py --settings eagle1-chain --new-tokens "$NEW_TOKENS" --concurrency "$CONCURRENCY" \
      --repeats "$REPEATS" --target-process --draft-process --gpu-busy 0,1 --target-device cuda:0 --draft-device cuda:1 \
      --engine-flags "--attention-backend flashinfer --dtype bfloat16" \
      --target-flags "--load-format dummy --config llama3-8b --simulate-accept-len $tau" \
      --draft-flags "$DRAFT --speculation $mode"
  done
done
if [ -n "${TINY:-}" ]; then
  for mode in "${modes[@]}"; do
    echo "== tiny pair (real acceptance), --speculation $mode"
    python bench/services_bench.py --settings eagle1-chain,eagle3-chain --new-tokens 128 --concurrency "$CONCURRENCY" \
      --target-process --draft-process --gpu-busy 0,1 --target-device cuda:0 --draft-device cuda:1 \
      --engine-flags "--attention-backend flashinfer --dtype bfloat16" --draft-flags "--speculation $mode" \
      || [ $? -eq 3 ]  # 3: an output differed from Generate (bf16 near-ties between batch kernels); go on
  done
fi
