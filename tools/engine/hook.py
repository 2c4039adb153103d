"""The routing hook's host cost a layer: `ExpertLoader.on_routing` and its prefetch, alone, on a built engine.

    python -m tools.engine.hook MODEL_DIR --load-format dummy --router-skew 1.0 --expert-policy fixed \
        --offload-per-layer 56 --gpu-memory-budget 40GiB --tokens 1 8 64

On the H200 the hook is most of an offloading step's host time (Qwen3-30B-A3B at 40 GiB: 16 of 23-24 ms a step,
48 layers; `docs/benchmarks/paper-scenario.md`). This calls the hook on every MoE layer in turn, as a pass does,
with random router inputs (they order the next layer's prefetch) and experts drawn with the shares of the
checkpoint's `expert_ranking.json` (`rimuru profile`; uniform without one), and reports per layer: the
median host time of the hook and of its prefetch, how many torch operations it dispatched (each one a kernel
launch or a copy on a GPU) and how many experts it copied. On CPU the times are Python and dispatch only (no
launch latency, no wait for the GPU), so the operation count is the figure to compare between commits there.
"""

import argparse
import contextlib
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rimuru.config import EngineConfig
from rimuru.engine import Engine
from rimuru.expert_ranking import ExpertRanking, find_ranking
from rimuru.serving.cli import add_engine_arguments, engine_options


class OperationCount(TorchDispatchMode):
    """Counts the aten operations dispatched while active, views (no kernel, no copy) left out."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view and func.__name__ != "lift_fresh"
        return func(*args, **(kwargs or {}))


def routed(shares: torch.Tensor, tokens: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """[T, K] distinct expert ids a token, drawn with the ranking's shares [E] (what `rimuru profile` measured)."""
    return torch.multinomial(shares.expand(tokens, -1), top_k, replacement=False, generator=generator)


def run_layer(manager, layer: int, hidden: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    """One hook call and its prefetch: (hook seconds, prefetch seconds) of host time."""
    start = time.perf_counter()
    prefetch = manager.on_routing(layer, hidden, ids)
    middle = time.perf_counter()
    if prefetch is not None:
        prefetch()
    return middle - start, time.perf_counter() - middle


def measure(engine: Engine, ranking: ExpertRanking, tokens: int, steps: int, seed: int) -> dict:
    manager, layers = engine.expert_manager.loader, engine.model_config.moe_layer_ids
    generator = torch.Generator().manual_seed(seed)
    shares = {layer: torch.tensor(ranking.shares[layer]) for layer in layers}
    top_k = engine.model_config.num_experts_per_tok
    dtype, device = engine.config.dtype, engine.device
    inputs = [torch.randn(tokens, engine.model_config.hidden_size, generator=generator).to(device, dtype)
              for _ in range(steps)]  # fmt: skip
    hook_s, prefetch_s, ops = [], [], []
    copied_before = manager.copier.bytes_copied
    for step, hidden in enumerate(inputs):
        picks = {layer: routed(shares[layer], tokens, top_k, generator).to(device) for layer in layers}
        counted = step == len(inputs) - 1  # the last pass counts operations; the mode slows what it watches
        for layer in layers:
            count = OperationCount()
            with count if counted else contextlib.nullcontext():
                hook, prefetch = run_layer(manager, layer, hidden, picks[layer])
            if counted:
                ops.append(count.count)
            elif step:  # the first pass warms caches
                hook_s.append(hook)
                prefetch_s.append(prefetch)
        if device.type == "cuda":
            torch.cuda.synchronize()
    experts_copied = (manager.copier.bytes_copied - copied_before) / (3 * engine.allocator.sizes.expert_page_bytes)
    return {
        "tokens": tokens,
        "hook_us": round(statistics.median(hook_s) * 1e6, 1),
        "prefetch_us": round(statistics.median(prefetch_s) * 1e6, 1),
        "operations": statistics.median(ops),
        "experts_copied": round(experts_copied / len(inputs) / len(layers), 2),  # a layer, prefetches and misses
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64], help="batch rows a hook call sees")
    parser.add_argument("--steps", type=int, default=20, help="passes over every MoE layer a batch size (>= 3)")
    parser.add_argument("--out", default=None, help="write the rows here as JSON")
    add_engine_arguments(parser)
    parser.set_defaults(expert_reads="copy")  # the hook runs only when host experts are copied in
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, **engine_options(args)))
    if not engine.expert_manager.is_active:
        parser.error("no expert is on the host: the hook would not run (use --expert-policy fixed)")
    mc = engine.model_config
    ranking = find_ranking(args.model, args.expert_ranking, mc.moe_layer_ids, mc.num_experts)
    rows = [measure(engine, ranking, tokens, args.steps, seed) for seed, tokens in enumerate(args.tokens)]
    device = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
    print(f"{device}, {len(engine.model_config.moe_layer_ids)} MoE layers, "
          f"{engine.experts.num_offloaded} experts on the host")  # fmt: skip
    engine.close()
    for row in rows:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "engine": engine_options(args), "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
