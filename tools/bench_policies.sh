#!/usr/bin/env bash
# Full-size Qwen1.5-MoE-A2.7B (dummy weights) on the synthetic stream: all resident on the whole GPU, then the
# 30 GiB card with resident, fixed and elastic experts. Results as JSON under $OUT. Run from the repository root.
#   bash tools/bench_policies.sh MODEL_DIR STREAM.jsonl
set -u
MODEL=$1 STREAM=$2 OUT=${OUT:-/tmp/out}
source tools/device_env.sh
mkdir -p "$OUT"
bench() { name=$1; shift; timeout "${LIMIT:-240}" python tools/bench_throughput.py "$MODEL" --stream "$STREAM" \
  --load-format dummy --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $(grep -h output_tokens_per_s "$OUT/$name.json" 2>/dev/null)"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
bench resident-whole --expert-policy resident ${WHOLE_ARGS:-}
python -m rimuru.serving.cli profile "$MODEL" --load-format dummy --router-skew 1.0 --workload "$STREAM" \
  --num-prompts 64 --max-tokens 8 --expert-policy resident > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
cp "$MODEL/expert_ranking.json" "$OUT/" 2>/dev/null
for policy in resident elastic fixed; do
  bench "$policy-30g" --expert-policy $policy --gpu-memory-budget 30GiB --router-skew 1.0 --max-num-batched-tokens 2048 \
    --expert-offload-limit 8 --offload-per-layer 8
done
