"""`profile_experts`: run sample requests and measure each MoE layer's share of routing probability per expert.

The share of expert e in layer l is the mean over routed tokens of softmax(router logits)[e]; the result is the
`ExpertRanking` the engine uses to keep hot experts resident. A forward pre-hook on each MoE block recomputes its
router's probabilities from the block's input, so profiling needs nothing from the engine but a normal run.
"""

import torch

from rimuru.engine import Engine
from rimuru.expert_ranking import ExpertRanking
from rimuru.sampling_params import SamplingParams


def profile_experts(engine: Engine, prompts: list, max_tokens: int = 16) -> ExpertRanking:
    """Generate `max_tokens` for each prompt (greedy, EOS ignored) and return the measured ranking."""
    layers = engine.model_config.moe_layer_ids
    totals = {layer: torch.zeros(engine.model_config.num_experts, dtype=torch.float64) for layer in layers}
    handles = [_observe(engine.loaded.model.model.layers[layer].mlp, totals[layer]) for layer in layers]
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"profile-{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()
    finally:
        for handle in handles:
            handle.remove()
    return ExpertRanking({layer: tuple((t / t.sum()).tolist()) for layer, t in totals.items()})


def _observe(moe_block: torch.nn.Module, total: torch.Tensor):
    def hook(module, inputs):
        logits = inputs[0].float() @ module.gate.weight.float().T  # [T, E]
        total.add_(logits.softmax(dim=-1).sum(dim=0).double().cpu())

    return moe_block.register_forward_pre_hook(hook)
