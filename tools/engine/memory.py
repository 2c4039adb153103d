"""The activation reserve against what the engine really takes: one engine, three phases, peak GPU memory of each.

    python -m tools.engine.memory MODEL_DIR --load-format dummy --gpu-memory-budget 30GiB \
        --max-num-batched-tokens 2048 --expert-policy resident --out memory.json

`rimuru.memory_plan` reserves, outside the page pool, an estimate of one forward pass of max_num_batched_tokens
(and of the CUDA graphs' passes); the paper-scenario runs peaked about 1.1 GB under their 30 GiB budget, so the
estimate may hold back KV pages the card has. This measures it. Phases, each from freshly reset peak statistics:

    start-up   the engine built: weights, pool, CUDA graphs captured (peaks since the process began)
    prefill    one prompt of max_num_batched_tokens tokens (or what max_model_len allows) in one step, greedy
    decode     max_num_seqs requests of 8-token prompts, sampled at temperature 1 with top-p 0.9 and logprobs,
               until each has 4 tokens: the widest logits and the sampler's temporaries

The record: the plan (weights, activation reserve, pool), each phase's peak allocated and reserved bytes, the
peak beyond weights and pool (what the reserve really had to cover) and the budget left unused at the peak. On
CPU there are no CUDA memory statistics: the phases run, the byte counts are None (the test suite runs it so).
"""

import argparse
import json
import random

import torch

from rimuru.config import EngineConfig
from rimuru.engine import Engine
from rimuru.sampling_params import SamplingParams
from rimuru.serving.cli import add_engine_arguments, engine_options

DECODE_PROMPT_TOKENS, DECODE_OUTPUT_TOKENS = 8, 4


def prefill_phase(engine: Engine, rng: random.Random) -> None:
    tokens = min(engine.config.max_num_batched_tokens, engine.config.max_model_len - 1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request("prefill", _prompt(engine, rng, tokens), params)
    _finish(engine)


def decode_phase(engine: Engine, rng: random.Random) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, logprobs=5, max_tokens=DECODE_OUTPUT_TOKENS, ignore_eos=True,
                            seed=0)  # fmt: skip
    for i in range(engine.config.max_num_seqs):
        engine.add_request(f"decode-{i}", _prompt(engine, rng, DECODE_PROMPT_TOKENS), params)
    _finish(engine)


def _prompt(engine: Engine, rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(engine.model_config.vocab_size) for _ in range(length)]


def _finish(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()
    _sync()


def measure(run) -> dict:
    """Peak allocated and reserved bytes while `run()` runs (None on CPU)."""
    if not torch.cuda.is_available():
        run()
        return {"peak_allocated": None, "peak_reserved": None}
    torch.cuda.reset_peak_memory_stats()
    run()
    return {"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}


def summary(engine: Engine, phases: dict[str, dict]) -> dict:
    plan = engine.memory_plan
    record = {"plan": {"budget": plan.budget_bytes, "weights": plan.weights_bytes,
                       "activation_reserve": plan.activation_bytes, "pool": plan.pool_bytes},
              "phases": phases}  # fmt: skip
    peaks = [p["peak_reserved"] for p in phases.values() if p["peak_reserved"] is not None]
    if peaks:
        record["reserve_used"] = max(peaks) - plan.weights_bytes - plan.pool_bytes
        if plan.budget_bytes is not None:
            record["budget_unused_at_peak"] = plan.budget_bytes - max(peaks)
    return record


def print_record(record: dict) -> None:
    plan = record["plan"]
    print("plan: " + ", ".join(f"{k} {mib(v)}" for k, v in plan.items()))
    for name, phase in record["phases"].items():
        print(f"  {name}: peak allocated {mib(phase['peak_allocated'])}, peak reserved {mib(phase['peak_reserved'])}")
    if "reserve_used" in record:
        print(f"reserve used {mib(record['reserve_used'])} of {mib(plan['activation_reserve'])}; "
              f"budget unused at the peak {mib(record.get('budget_unused_at_peak'))}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--out", default=None, help="write the record here as JSON")
    add_engine_arguments(parser)
    args = parser.parse_args()
    rng = random.Random(0)
    engine = None

    def build() -> None:
        nonlocal engine
        engine = Engine(EngineConfig(model=args.model, **engine_options(args)))

    phases = {"start-up": measure(build)}
    phases["prefill"] = measure(lambda: prefill_phase(engine, rng))
    phases["decode"] = measure(lambda: decode_phase(engine, rng))
    record = summary(engine, phases) | {"engine": engine_options(args), "model": args.model,
                                        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    engine.close()
    print_record(record)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=str)


def mib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:,.0f} MiB"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
