#!/usr/bin/env bash
# Full-size Qwen1.5-MoE-A2.7B (dummy weights) on a request stream: all resident on the whole GPU, a ranking from
# `rimuru profile`, then the 30 GiB card with resident, fixed and elastic experts. Records (`rimuru bench` JSON)
# under $OUT. Run from the repository root on the GPU machine:  bash tools/bench_policies.sh MODEL_DIR STREAM.jsonl
set -u
MODEL=$1 STREAM=$2 OUT=${OUT:-/tmp/out} RATE=${RATE:-0}
source tools/device_env.sh
mkdir -p "$OUT"
bench() { name=$1; shift; timeout "${LIMIT:-240}" python tools/cli.py bench "$MODEL" --stream "$STREAM" --rate "$RATE" \
  --load-format dummy --quiet --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; }
bench resident-whole --expert-policy resident
python tools/cli.py profile "$MODEL" --load-format dummy --router-skew 1.0 --workload "$STREAM" --num-prompts 64 \
  --max-tokens 8 --expert-policy resident > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
SCENARIO=(--gpu-memory-budget 30GiB --router-skew 1.0 --max-num-batched-tokens 2048)
bench resident-30g --expert-policy resident "${SCENARIO[@]}"
bench fixed-30g --expert-policy fixed --offload-per-layer 8 "${SCENARIO[@]}"
bench elastic-30g --expert-policy elastic --expert-offload-limit 8 "${SCENARIO[@]}"
