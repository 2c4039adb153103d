"""`profile_experts`: run sample requests and measure each MoE layer's share of routing probability per expert.

The share of expert e in layer l is the mean over routed tokens of softmax(router logits)[e]; the result is the
`ExpertRanking` the engine uses to keep hot experts resident. An observer of the routing counter recomputes each
router's probabilities from its input at every routing, so profiling needs nothing from the engine but a run of
eager passes (CUDA graphs keep the routers' inputs only for copied experts).
"""

import torch

from rimuru.engine import Engine
from rimuru.expert_ranking import ExpertRanking
from rimuru.sampling_params import SamplingParams


def profile_experts(engine: Engine, prompts: list, max_tokens: int = 16) -> ExpertRanking:
    """Generate `max_tokens` for each prompt (greedy, EOS ignored) and return the measured ranking."""
    layers = engine.model_config.moe_layer_ids
    totals = {layer: torch.zeros(engine.model_config.num_experts, dtype=torch.float64) for layer in layers}
    routers = {layer: engine.loaded.model.model.layers[layer].mlp.gate.weight for layer in layers}

    def observe(layer: int, hidden: torch.Tensor | None, topk_ids: torch.Tensor) -> None:
        if hidden is None:
            raise RuntimeError("profiling reads the routers' inputs: build the engine with cuda_graphs=False")
        logits = hidden.float() @ routers[layer].float().T  # [T, E]
        totals[layer].add_(logits.softmax(dim=-1).sum(dim=0).double().cpu())

    observers = engine.expert_manager.counter.observers
    observers.append(observe)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"profile-{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()
    finally:
        observers.remove(observe)
    return ExpertRanking({layer: tuple((t / t.sum()).tolist()) for layer, t in totals.items()})
