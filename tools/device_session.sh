#!/usr/bin/env bash
# The GPU measurements still owed, as named jobs for one device call each (run from the repository root, with
# `.bench` carried: MODEL's config.json and the JSONL streams; `.whl` carried for `serve`). Results under $OUT.
#   bash tools/device_session.sh profile serve          # jobs run in the order given
#   MODEL=.bench/qwen1.5-moe-a2.7b STREAM=.bench/stream-200-r0.jsonl bash tools/device_session.sh scenario
# Prepare .bench on the developer machine first (it is git-ignored):
#   mkdir -p .bench/qwen1.5-moe-a2.7b && cp ../shared/models/qwen1.5-moe-a2.7b/config.json .bench/qwen1.5-moe-a2.7b/
#   python3 ../shared/workloads/sharegpt_synth.py --num 200 --rate 0 --seed 0 > .bench/stream-200-r0.jsonl
#   python3 ../shared/workloads/sharegpt_synth.py --num 400 --rate 0 --seed 0 > .bench/stream-400-r0.jsonl
#   python3 ../shared/workloads/sharegpt_synth.py --num 100 --rate 10 --seed 0 > .bench/stream-100-r10.jsonl
# and the profiled expert rankings, which save the jobs a minute of profiling each (same seeds and skews):
#   cp docs/benchmarks/qwen1.5-moe-skew1-expert_ranking.json .bench/qwen1.5-moe-a2.7b/expert_ranking.json
#   cp docs/benchmarks/paper-scenario/expert_ranking-qwen1.5-skew0.5.json .bench/qwen1.5-moe-a2.7b/expert_ranking-skew0.5.json
#   cp docs/benchmarks/paper-scenario/expert_ranking-qwen1.5-skew2.0.json .bench/qwen1.5-moe-a2.7b/expert_ranking-skew2.0.json
#   mkdir -p .bench/qwen3-30b-a3b && cp ../shared/models/qwen3-30b-a3b/config.json .bench/qwen3-30b-a3b/
#   cp docs/benchmarks/qwen3-30b-a3b-skew1-expert_ranking.json .bench/qwen3-30b-a3b/expert_ranking.json
# Jobs:
#   gputests  every @pytest.mark.gpu test (ops, models, engine: CUDA graphs against eager); GPUTESTS=paths narrows it
#   tunewide  retune Qwen3's M = 1024 over a wider tile space (BLOCK_K 128, BLOCK_N 256, 5 stages) into
#             $OUT/NVIDIA_H200.json (a copy; ~5 min)
#   kernels   the split-KV decode attention sweep and the top-k sum (docs/benchmarks/kernels.md)
#   anchors   the MoE op at the anchor points (M = 1, 8, 64, 256, 1024, 4096), large M first and then small M first,
#             GPU clocks logged: $OUT/anchors-from-*.json, anchors-gpu-clocks.csv (~2 min)
#   launch    the host's time to launch the MoE op eagerly beside its GPU time, PDL and L2 hints on and off
#             (tools/bench_launch.py, M = 1, 4, 64; ~1 min)
#   breakdown the MoE op piece by piece under CUDA graphs, M = 1..4096 (bench_kernels.py --breakdown, ~1 min)
#   decodesweep  the decode attention variants against the general kernel (sweep_decode_attention.py, ~1.5 min)
#   opsgpu    the @pytest.mark.gpu tests of tests/ops only (~2 min)
#   tunesmall retune both models' M = 1..16 tiles and the PAIR_BLOCKS choice (the op sorted or one M block a pair) into
#             $OUT/NVIDIA_H200.json (a copy; ~6 min)
#   tunelarge retune both models' M = 512..4096 tiles, GROUP_M (the program order) now in the space, into
#             $OUT/NVIDIA_H200.json (a copy; ~7-9 min: its own call; commit it, then run `breakdown`)
#   profile   where a decode step of 200 requests spends its time (tools/profile_step.py); PROFILE_FLAGS="--num-requests
#             64 --gpu-memory-budget 30GiB --expert-policy fixed --offload-per-layer 8 --expert-reads copy" profiles
#             the routing hook
#   throughput  rimuru bench, all experts resident on the whole GPU, the stream all at once (engine.md)
#   serve     rimuru serve + tools/bench_serve.py at 10 requests/s, TTFT/TPOT/ITL from streamed token ids
#   scenario  rimuru bench at $BUDGET (30GiB): resident, fixed-8, elastic-8 (paper rule), elastic-8 (cost rule) at $RATE,
#             one process (tools/bench_sweep.py); records and logs in $OUT/scenario-r$RATE.tar.gz. POLICIES="resident
#             fixed8 elastic cost-direct ..." picks others (names: see run_spec)
#   defaults  elastic at the default offload limit (a quarter of each layer's experts), paper rule and cost rule, at
#             $RATE; $OUT/defaults-r$RATE.tar.gz
#   limits    the sweeps: elastic with limits 4, 12, 16 and fixed with 4 and 16 at $RATE; $OUT/limits-r$RATE.tar.gz
#   direct    tools/bench_direct_reads.py (the MoE op reading host experts in place against copying them), then
#             fixed-8 and elastic-8 with --expert-reads direct at $RATE; $OUT/direct-r$RATE.tar.gz
#   qwen3     Qwen3-30B-A3B at 40 GiB (weights do not fit): fixed-56, elastic-64, elastic-64 with direct reads (POLICIES)
#   memory    the activation reserve against the peaks of start-up, a 2048-token prefill and a 256-request sampled
#             decode (tools/measure_memory.py), resident and elastic at $BUDGET; $OUT/memory-<policy>.json (~2 min)
#   hook      the routing hook's host time and operations a layer (tools/bench_hook.py): $MODEL fixed-8 at $BUDGET, ~1 min
#   scheduler a scheduling round of 140 decodes, the page tables' device copy synced once (and, given
#             .bench/kv_cache_before.py, alternated with the copies at each allocation before 026cd3f), ~30 s
#   sampler   a step of 140 sampled (temperature, top-p) requests: the batched sampler, and given
#             .bench/sampler_before.py the one-row-at-a-time one before it, ~30 s
#   cache     (last) Triton's kernel cache as $OUT/triton-cache.tar.gz.part-*: copy the parts to .bench/ here (and
#             remove an older triton-cache.tar.gz; tools/device_env.sh unpacks them on the device), so later calls
#             skip the compiles
#   hostphases  the host time of each part of a decode step (tools/profile_step.py), paper rule against cost rule:
#             $MODEL at $BUDGET, PROFILE_FLAGS (default --num-requests 1), ~1 min each
#   defaults3 Qwen3-30B-A3B with no policy flags at BUDGETS (24 32 40 GiB), each beside FIXED (fixed64 fixed80
#             fixed96) in one process; records in $OUT/qwen3-<B>g-<policy>-r$RATE.tar.gz (~2 min a run)
#   shift     the scenario with a stream whose prompts move to the other half of the vocabulary halfway
#             (tools/shift_stream.py, dummy weights with --router-regimes 2, ranking profiled on the first half):
#             fixed-8, elastic-8 and cost-8 (whose swaps follow the shift); $OUT/shift-r$RATE.tar.gz
set -u
OUT=${OUT:-/tmp/out} MODEL=${MODEL:-.bench/qwen1.5-moe-a2.7b} STREAM=${STREAM:-.bench/stream-200-r0.jsonl}
RATE=${RATE:-0} BUDGET=${BUDGET:-30GiB} SERVE_STREAM=${SERVE_STREAM:-.bench/stream-100-r10.jsonl}
mkdir -p "$OUT"
source tools/device_env.sh
# NOTE: give RIMURU_COMMIT literally (RIMURU_COMMIT=480ab55 bash tools/device_session.sh ...): the device's copy of
# the tree can carry git metadata older than its files, so `git rev-parse` there may name an earlier commit
export RIMURU_COMMIT=${RIMURU_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DUMMY=()
[ -f "$MODEL/model.safetensors" ] || [ -f "$MODEL/model.safetensors.index.json" ] || DUMMY=(--load-format dummy)

gputests() {
  # -P and --import-mode=append: the repository's own `rimuru/` folder must not shadow the package in /tmp/pkg
  python -P -m pytest -q -p no:cacheprovider --import-mode=append --durations=15 -m gpu ${GPUTESTS:-tests/ops tests/models tests/engine} \
    > "$OUT/gputests.log" 2>&1
  tail -32 "$OUT/gputests.log"
}

breakdown() {
  timeout 300 python tools/bench_kernels.py --breakdown --out "$OUT/breakdown.json" > "$OUT/breakdown.txt" 2>&1
  echo "rc=$?"; tail -14 "$OUT/breakdown.txt"
}

decodesweep() {
  timeout 300 python tools/sweep_decode_attention.py --out "$OUT/decode_sweep.json" > "$OUT/decode_sweep.txt" 2>&1
  echo "rc=$?"; grep -v "^  warn" "$OUT/decode_sweep.txt" | tail -60
}

opsgpu() {  # = GPUTESTS=tests/ops gputests, with its own log
  timeout 300 python -P -m pytest -q -p no:cacheprovider --import-mode=append -m gpu tests/ops > "$OUT/opsgpu.log" 2>&1
  tail -8 "$OUT/opsgpu.log"
}

tunesmall() {  # compare with ops/configs/NVIDIA_H200.json, then copy the buckets that improved
  cp ops/configs/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
  timeout 420 python tools/tune_kernels.py --budget-s 360 --m 1 2 4 8 16 --out "$OUT/NVIDIA_H200.json" \
    2>&1 | tee "$OUT/tunesmall.txt" | tail -6
}

tunelarge() {  # compare with ops/configs/NVIDIA_H200.json; copy it back here to keep what improved
  cp ops/configs/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
  timeout 480 python tools/tune_kernels.py --budget-s 420 --m 512 1024 2048 4096 --out "$OUT/NVIDIA_H200.json" \
    2>&1 | tee "$OUT/tunelarge.txt" | tail -10
}

tunewide() {  # Qwen3's M = 1024 over the wider large-M space (`tune_kernels.search_space`, wide), ~5 min
  cp ops/configs/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
  timeout 480 python tools/tune_kernels.py --budget-s 420 --models qwen3-30b-a3b --m 1024 --wide \
    --out "$OUT/NVIDIA_H200.json" 2>&1 | tee "$OUT/tunewide.txt" | tail -4
}

anchors() {  # the MoE sweep's anchor points large M first, then small M first, clocks logged (~2 min): does the
  # order, through the GPU's clocks, move the large-M op times? (kernels.md: 780 us first in a row, 822-831 last)
  local clocks; clocks=$(log_clocks "$OUT/anchors-gpu-clocks.csv")
  for order in "4096 1024 256 64 8 1" "1 8 64 256 1024 4096"; do
    local name="anchors-from-${order%% *}"
    # shellcheck disable=SC2086
    timeout 200 python tools/bench_kernels.py --skip-attention --m $order --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
    echo "-- $name rc=$?"; grep -A14 "^model M" "$OUT/$name.txt"
  done
  [ -n "$clocks" ] && kill "$clocks" 2> /dev/null
}

launch() {  # the host's time to launch the MoE op eagerly against the GPU's, PDL and L2 hints on and off (~1 min)
  timeout 200 python tools/bench_launch.py --out "$OUT/launch.json" > "$OUT/launch.txt" 2>&1
  echo "rc=$?"; tail -20 "$OUT/launch.txt"
}

kernels() {
  python tools/bench_kernels.py --skip-moe --out "$OUT/kernels_decode.json" > "$OUT/kernels_decode.txt" 2>&1
  tail -40 "$OUT/kernels_decode.txt"
}

profile() {
  # shellcheck disable=SC2086
  python tools/profile_step.py "$MODEL" "${DUMMY[@]}" --stream "$STREAM" --steps 20 \
    ${PROFILE_FLAGS:---num-requests 200 --expert-policy resident} --trace "$OUT/step_trace.json" > "$OUT/profile_step.txt" 2>&1
  gzip -f "$OUT/step_trace.json"  # several MB of JSON: the fetch limit is 16 MiB a file
  head -40 "$OUT/profile_step.txt"
}

throughput() {
  timeout 280 python tools/cli.py bench "$MODEL" --stream "$STREAM" --rate 0 --expert-policy resident --quiet \
    "${DUMMY[@]}" --out "$OUT/throughput-whole.json" > "$OUT/throughput-whole.log" 2>&1
  echo "resident, whole GPU: rc=$? $(grep -m1 -h output_tokens_per_s "$OUT/throughput-whole.log")"
}

serve() {
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  python tools/cli.py serve "$MODEL" "${DUMMY[@]}" --port 8000 > "$OUT/server.log" 2>&1 &
  local server=$!
  for _ in $(seq 180); do curl -sf localhost:8000/health > /dev/null && break; sleep 1; done
  timeout 300 python tools/bench_serve.py --stream "$SERVE_STREAM" --out "$OUT/serving-h200.json" 2>&1 | tail -12
  kill -TERM $server; wait $server
}

# log_clocks FILE: SM and memory clocks, power and temperature every 0.5 s into FILE, in the background; prints the
# logger's pid (nothing without nvidia-smi) for the caller to kill
log_clocks() {
  command -v nvidia-smi > /dev/null || return 0
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 500 > "$1" 2>&1 &
  echo $!
}

# sweep NAME STREAM RANKING SKEW_FLAGS RUN...: one bench_sweep process (the checkpoint loaded once; BENCH_FLAGS go to
# every run, e.g. "--time-limit-s 120"; REPEAT=2 runs the list twice in turn and prints each policy's spread), then
# the throughput lines, and every record and log in $OUT/NAME.tar.gz (8 files at most come back)
sweep() {
  local name=$1 stream=$2 ranking=$3 skew=$4; shift 4
  local dir="$OUT/$name" runs=() clocks=""
  for run in "$@"; do runs+=(--run "$run"); done
  mkdir -p "$dir"
  clocks=$(log_clocks "$dir/gpu-clocks.csv")  # does the first run in a process run faster because the GPU is cool?
  python tools/bench_sweep.py "$MODEL" --out-dir "$dir" --ranking "$ranking" --repeat "${REPEAT:-1}" \
    --common "--stream $stream --rate $RATE --gpu-memory-budget $BUDGET $skew --max-num-batched-tokens 2048 --quiet ${DUMMY[*]} ${BENCH_FLAGS:-}" \
    --profile "${DUMMY[*]} $skew --workload $stream --num-prompts 64 --max-tokens 8 --expert-policy resident" "${runs[@]}"
  [ -n "$clocks" ] && kill "$clocks" 2> /dev/null
  cp "$ranking" "$dir/" 2>/dev/null
  for log in "$dir"/*.log; do echo "$(basename "$log") $(grep -m1 -h output_tokens_per_s "$log")"; done
  tar -czf "$dir.tar.gz" -C "$OUT" "$name" && rm -r "$dir"
}

# run_spec NAME: a policy's bench flags from its name: resident, fixedN, elasticN (the paper rule: --adjuster paper
# since the cost rule became the default), costN, elastic and cost (the default offload limit), each with any of the
# suffixes -copy (host experts copied in: the routing hook and the prefetch; the default since ff88579 is direct
# reads), -direct (the kernels read host experts in place, as a plain name does now; records before ff88579 copied),
# -mixed (steps with prefill replay CUDA graphs too) and -sloS (the cost rule evicts despite the cost once a request
# has waited S seconds: --ttft-slo S), e.g. elastic-copy-mixed, cost-slo2
run_spec() {
  local name=$1 base=$1 extra="" flags
  while true; do
    case $base in
      *-direct) base=${base%-direct}; extra="$extra --expert-reads direct" ;;
      *-copy) base=${base%-copy}; extra="$extra --expert-reads copy" ;;
      *-mixed) base=${base%-mixed}; extra="$extra --mixed-cuda-graphs" ;;
      *-slo*) extra="$extra --ttft-slo ${base##*-slo}"; base=${base%-slo*} ;;
      *) break ;;
    esac
  done
  case $base in
    default) flags="" ;;  # no policy flags: what a user gets
    resident) flags="--expert-policy resident" ;;
    fixed*) flags="--expert-policy fixed --offload-per-layer ${base#fixed}" ;;
    elastic) flags="--expert-policy elastic --adjuster paper" ;;
    elastic*) flags="--expert-policy elastic --adjuster paper --expert-offload-limit ${base#elastic}" ;;
    cost) flags="--expert-policy elastic --adjuster cost" ;;
    cost*) flags="--expert-policy elastic --adjuster cost --expert-offload-limit ${base#cost}" ;;
    *) echo "unknown policy $name" >&2; return 1 ;;
  esac
  echo "$name=$flags$extra"
}

# policies NAME STREAM RANKING SKEW POLICY...: `sweep` over policies given by name
policies() {
  local name=$1 stream=$2 ranking=$3 skew=$4 specs=() policy; shift 4
  for policy in "$@"; do specs+=("$(run_spec "$policy")") || return 1; done
  sweep "$name" "$stream" "$ranking" "$skew" "${specs[@]}"
}

SKEW_FLAGS="--router-skew ${SKEW:-1.0}"

# ranking_path: $MODEL's profiled ranking at this skew (`sweep` profiles it when missing): expert_ranking.json at
# the default skew of 1.0, expert_ranking-skew<S>.json at another
ranking_path() {
  if [ "${SKEW:-1.0}" = 1.0 ]; then echo "$MODEL/expert_ranking.json"; else echo "$MODEL/expert_ranking-skew$SKEW.json"; fi
}

scenario() {  # POLICIES overrides the set
  # shellcheck disable=SC2086
  policies "scenario-r$RATE" "$STREAM" "$(ranking_path)" "$SKEW_FLAGS" ${POLICIES:-resident fixed8 elastic8 cost8}
}

defaults() {  # what a user gets without tuning: elastic at the default limit, both adjusters
  policies "defaults-r$RATE" "$STREAM" "$(ranking_path)" "$SKEW_FLAGS" elastic cost
}

limits() {  # the paper scenario's sweeps: elastic at offload limits 4, 12, 16, fixed at 4 and 16
  policies "limits-r$RATE" "$STREAM" "$(ranking_path)" "$SKEW_FLAGS" elastic4 elastic12 elastic16 fixed4 fixed16
}

direct() {  # the MoE op reading host experts in place, then fixed-8 and elastic-8 with direct reads at $RATE
  python tools/bench_direct_reads.py --out "$OUT/direct_reads.json" 2>&1 | tail -18
  policies "direct-r$RATE" "$STREAM" "$(ranking_path)" "$SKEW_FLAGS" fixed8-direct elastic8-direct
}

qwen3() {  # the does-not-fit scenario: Qwen3-30B-A3B (58 GB of experts) on a 40 GiB card
  # NOTE: the pool holds about 65% of the experts, so at least 48 of each layer's 128 must live on the host
  # NOTE: PCIe-bound (a step copies or reads several GB of host experts): each run stops at 120 s and records the
  # part that ran (truncated_at_s); use a short stream such as .bench/stream-100-r10.jsonl
  local MODEL=.bench/qwen3-30b-a3b BUDGET=40GiB BENCH_FLAGS="--time-limit-s ${TIME_LIMIT_S:-120} ${BENCH_FLAGS:-}"
  # shellcheck disable=SC2086
  policies "qwen3-40g-r$RATE" "$STREAM" "$(ranking_path)" "$SKEW_FLAGS" ${POLICIES:-fixed56 elastic64 elastic64-direct}
}

defaults3() {  # issue 26: Qwen3-30B-A3B with no policy flags at 24, 32, 40 GiB beside a fixed-offload sweep, per budget
  local MODEL=.bench/qwen3-30b-a3b BENCH_FLAGS="--time-limit-s ${TIME_LIMIT_S:-90} ${BENCH_FLAGS:-}" b
  for b in ${BUDGETS:-24 32 40}; do
    for p in default ${FIXED:-fixed64 fixed80 fixed96}; do  # a process each: a second engine in one process hit a cuBLAS error
      BUDGET=${b}GiB policies "qwen3-${b}g-$p-r$RATE" "$STREAM" "$(ranking_path)" "$SKEW_FLAGS" "$p"
    done
  done
}

shift_run() {  # job "shift": the distribution-shift run of the cost-aware adjuster issue
  local shifted=.bench/stream-shift.jsonl vocab
  vocab=$(python -c "import json; print(json.load(open('$MODEL/config.json'))['vocab_size'])")
  python tools/shift_stream.py "$STREAM" --vocab-size "$vocab" > "$shifted"
  policies "shift-r$RATE" "$shifted" /tmp/ranking-first-half.json "$SKEW_FLAGS --router-regimes 2" fixed8 elastic8 cost8
}

memory() {  # the activation reserve against measured peaks: resident (decode graphs) and elastic (mixed graphs too)
  # MEMORY_POLICIES="fixed" MEMORY_FLAGS="--offload-per-layer 16" measures others
  for policy in ${MEMORY_POLICIES:-resident elastic}; do
    echo "-- $policy"
    # shellcheck disable=SC2086
    timeout 240 python tools/measure_memory.py "$MODEL" "${DUMMY[@]}" --gpu-memory-budget "$BUDGET" \
      --max-num-batched-tokens 2048 --expert-policy "$policy" ${MEMORY_FLAGS:-} --out "$OUT/memory-$policy.json" 2>&1 | tail -6
  done
}

hook() {  # no graphs captured: the hook runs outside them anyway
  # shellcheck disable=SC2086
  timeout 200 python tools/bench_hook.py "$MODEL" "${DUMMY[@]}" $SKEW_FLAGS --gpu-memory-budget "$BUDGET" \
    --expert-policy fixed --offload-per-layer 8 --no-cuda-graphs --tokens 1 8 64 256 --out "$OUT/hook.json" 2>&1 | tail -6
}

hostphases() {  # the host time of each part of a decode step, paper rule against cost rule ($MODEL at $BUDGET)
  local ranking; ranking=$(ranking_path)
  for adjuster in paper cost; do
    # shellcheck disable=SC2086
    timeout 150 python tools/profile_step.py "$MODEL" "${DUMMY[@]}" --stream "$STREAM" --steps 100 \
      --gpu-memory-budget "$BUDGET" --expert-ranking "$ranking" --adjuster "$adjuster" --max-num-seqs 8 \
      --no-mixed-cuda-graphs $SKEW_FLAGS ${PROFILE_FLAGS:---num-requests 1} > "$OUT/hostphases-$(basename "$MODEL")-$adjuster.txt" 2>&1
    echo "-- $adjuster"; grep -E "^decode step|^  " "$OUT/hostphases-$(basename "$MODEL")-$adjuster.txt" | head -14
  done
}

scheduler() {  # a scheduling round of 140 decodes with the page tables on the GPU (tools/bench_scheduler.py), and
  # given .bench/kv_cache_before.py (`git show b2a86f2:rimuru/kv_cache.py`: a copy at each page allocation) and
  # .bench/model_runner_before.py (`git show 0d983eb:rimuru/model_runner.py`) its rounds alternated with theirs
  local against=(); [ -f .bench/kv_cache_before.py ] && against=(--against .bench/kv_cache_before.py)
  [ -f .bench/model_runner_before.py ] && against+=(--against-runner .bench/model_runner_before.py)
  python tools/bench_scheduler.py --device cuda "${against[@]}" | tee "$OUT/scheduler.json"
}

sampler() {  # a step of 140 sampled requests, Qwen's vocabulary (tools/bench_sampler.py); given
  # .bench/sampler_before.py (`git show bc32907:rimuru/sampler.py`: a few kernels a row) that one alternated
  local against=(); [ -f .bench/sampler_before.py ] && against=(--against .bench/sampler_before.py)
  python tools/bench_sampler.py --device cuda "${against[@]}" 2> /dev/null | tee "$OUT/sampler.json"
}

# vsvllm: vLLM 0.26 and Rimuru (all experts resident, and the default policy) on the same config, budget and streams
# in one call (docs/benchmarks/vs-vllm.md). vLLM's parts must be in /tmp/parts (see ../shared/peers/vllm/README.md:
# one call a part, carrying .peers/vllm/vllm.part-0N); carry .peers/vllm/bin and .bench. VS_STREAMS (default the
# 400 at 10/s and 200 at once streams), VS_POLICIES ("resident default"), ORDER=rimuru-first to alternate, CALL
# names the call in vs-vllm.json. VS_VLLM_RECORDS=DIR takes vLLM's records of an earlier call from DIR (carried)
# instead of running it again (/tmp/vllm-last holds the last call's while the machine stays warm). Records, logs and the merged table in $OUT.
vsvllm() {
  local dir="$OUT/vs" streams=(${VS_STREAMS:-.bench/stream-400-r10.jsonl .bench/stream-200-r0.jsonl}) runs=() s p
  mkdir -p "$dir"
  [ -n "${VS_VLLM_RECORDS:-}" ] || [ -f /tmp/vsite/env.sh ] || bash .peers/vllm/install.sh .peers/vllm/bin \
    > "$dir/vllm-install.log" 2>&1 || { tail -5 "$dir/vllm-install.log"; return 1; }
  for s in "${streams[@]}"; do
    for p in ${VS_POLICIES:-resident default}; do
      case $p in
        default) runs+=(--run "$p-$(basename "$s" .jsonl)=--stream $s") ;;
        *) runs+=(--run "$(run_spec "$p" | sed "s|^$p=|$p-$(basename "$s" .jsonl)=|") --stream $s") ;;
      esac
    done
  done
  local vllm_cmd=(python tools/vllm_replay.py "$MODEL" --budget-gib "${BUDGET%GiB}" --out-dir "$dir")
  for s in "${streams[@]}"; do vllm_cmd+=(--stream "$s"); done
  run_vllm() {
    if [ -n "${VS_VLLM_RECORDS:-}" ]; then cp "$VS_VLLM_RECORDS"/vllm-*.json "$dir/"; return; fi
    (source /tmp/vsite/env.sh && "${vllm_cmd[@]}") > "$dir/vllm.log" 2>&1; grep -h output_tokens_per_s "$dir"/vllm-*.json | cut -c1-200
    rm -rf /tmp/vllm-last && mkdir -p /tmp/vllm-last && cp "$dir"/vllm-*.json /tmp/vllm-last/  # VS_VLLM_RECORDS for a later call
  }
  run_rimuru() {
    python tools/bench_sweep.py "$MODEL" --out-dir "$dir" --ranking "$MODEL/expert_ranking-vs.json" \
      --common "--gpu-memory-budget $BUDGET --max-num-batched-tokens 2048 --quiet ${DUMMY[*]} ${BENCH_FLAGS:-}" "${runs[@]}"
  }
  if [ "${ORDER:-vllm-first}" = rimuru-first ]; then run_rimuru; run_vllm; else run_vllm; run_rimuru; fi
  local specs=()
  for s in "${streams[@]}"; do
    specs+=("vllm=$dir/vllm-$(basename "$s" .jsonl).json")
    for p in ${VS_POLICIES:-resident default}; do specs+=("$p=$dir/$p-$(basename "$s" .jsonl).json"); done
  done
  cp docs/benchmarks/vs-vllm.json "$OUT/vs-vllm.json" 2>/dev/null
  python tools/vs_vllm.py --call "${CALL:-$RIMURU_COMMIT}" --commit "$RIMURU_COMMIT" --json "$OUT/vs-vllm.json" \
    --table "$OUT/vs-vllm-table.md" "${specs[@]}"
  cat "$OUT/vs-vllm-table.md"
  grep -h "KV cache\|profiled\|weights .* GiB on" "$dir"/*.log | sort | uniq -c | head -20
  tar -czf "$OUT/vs-records.tar.gz" -C "$OUT" vs && rm -r "$dir"
}

cache() {  # last in a call: Triton's compiled kernels, to carry in .bench next time (tools/device_env.sh unpacks them)
  [ -d "$TRITON_CACHE_DIR" ] || { echo "no Triton cache at $TRITON_CACHE_DIR"; return; }
  # NOTE: in parts of 15 MB: one file over 16 MiB does not come back (23 MB at ad6a144)
  tar -czf - -C "$TRITON_CACHE_DIR" . | split -b 15M - "$OUT/triton-cache.tar.gz.part-" && du -ch "$OUT"/triton-cache.*
}

for job in "$@"; do
  [ "$job" = shift ] && job=shift_run  # `shift` is a shell builtin
  echo "== $job"; "$job"
done
