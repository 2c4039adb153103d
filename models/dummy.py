"""Random weights from a config alone (`load_format="dummy"`), for full-size benchmarks without a checkpoint.

Non-expert weights are generated on the target device; routed experts are generated there chunk by chunk too
(fast on a GPU) and copied to host memory, where the expert store expects them. Deterministic for a seed.

Scales are chosen so that routing behaves like a trained model's, not like i.i.d. noise, where every token's hidden
state collapses onto the same direction after a few layers and all tokens pick the same experts:
  * embeddings ~ N(0, 1), so token identity dominates the residual stream;
  * matrices that write into the residual stream (`o_proj`, a linear attention's `out_proj`, every down projection)
    ~ N(0, r / sqrt(2 L)) with r = initializer_range (GPT-2's residual scaling), so the stream grows little over L
    layers;
  * routers ~ N(0, 1 / sqrt(D)), so router logits have a standard deviation near 1;
  * every other matrix and bias ~ N(0, r); norms scale by 1 (a zero-centred norm's stored weight is 0).

`router_skew` (s > 0) makes expert popularity Zipf-like, deterministically:
  * dimension 0 of the residual stream becomes a constant "sink": every embedding row holds `sqrt(D)` there (as
    much as the rest of the row) and no layer writes to it (row 0 of every `o_proj`, its bias, and every down
    projection, dense, shared or routed, is zero; column 0 of `lm_head` is zero so the sink does not bias the
    vocabulary);
  * each MoE layer draws a random ranking of its experts (`rank[e]`, 0 = most popular) and sets router column 0
    to `-s * log(rank[e] + 1) / sqrt(D / 2)`.
  After the RMSNorm the sink coordinate is about sqrt(D / 2), so expert e's router logit gets about
  `-s * log(rank[e] + 1)`: on top of the token-dependent logits (std ~1), its odds against the favourite fall
  like `(rank + 1) ** -s`. s = 0 adds no sink and leaves the weights as above.

`router_regimes` (R > 1, with a skew) gives popularity that follows the tokens, for distribution-shift runs: the
vocabulary is cut into R contiguous parts (`regime_rows`), a token of part r carries its sink in dimension r, and
each MoE layer draws R rankings, one per router column 0..R-1. The LM head gets `REGIME_LOGIT` for the tokens of
the input's own part, so decoding stays in the part its prompt came from: a stream whose prompts move to another
part (tools/engine/shift_stream.py) moves every layer's popular experts with them.
"""

import math

import torch
from tqdm import tqdm

from rimuru.models.checkpoint import ExpertWeights
from rimuru.models.config import ModelConfig


def fill_dummy_weights(weights: dict[str, torch.Tensor], config: ModelConfig, seed: int) -> None:
    """Random non-expert weights at the scales of the module docstring, in place (checkpoint key -> its tensor, in
    the model's order; tied weights appear once)."""
    gen = torch.Generator(device=next(iter(weights.values())).device).manual_seed(seed)
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            tensor.fill_(_unit_norm_weight(name, config))
        else:
            tensor.normal_(0.0, _std(name, config), generator=gen)


def _std(name: str, config: ModelConfig) -> float:
    if name == "model.embed_tokens.weight":
        return 1.0
    if name.endswith("mlp.gate.weight"):
        return config.hidden_size**-0.5
    if name.endswith(("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight")):
        return _residual_std(config)
    return config.initializer_range


def _unit_norm_weight(name: str, config: ModelConfig) -> float:
    """The weight that scales a norm's output by one: a hybrid's norms store theirs around zero (x̂ · (1 + w)), but
    for the gated norm inside its linear attention (x̂ · w)."""
    return 0.0 if config.linear_layer_ids and not name.endswith("linear_attn.norm.weight") else 1.0


def _residual_std(config: ModelConfig) -> float:
    return config.initializer_range / math.sqrt(2 * config.num_hidden_layers)


def dummy_experts(config: ModelConfig, device, dtype, seed: int, progress: bool = False) -> dict[int, ExpertWeights]:
    """Every MoE layer's routed experts in (pinned) host memory; a progress bar over the layers with `progress`
    (Qwen3-30B-A3B's are 58 GB)."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    r, experts = config.initializer_range, {}
    for layer_idx in tqdm(config.moe_layer_ids, desc="Random experts", unit="layer", disable=not progress):
        weights = ExpertWeights.empty(config.num_experts, config.moe_intermediate_size, config.hidden_size, dtype)
        for host, std in zip((weights.gate, weights.up, weights.down), (r, r, _residual_std(config))):
            for chunk in host.split(max(1, host.shape[0] // 8)):  # bounded device scratch
                scratch = torch.empty(chunk.shape, device=device, dtype=dtype)
                chunk.copy_(scratch.normal_(0.0, std, generator=gen))
        experts[layer_idx] = weights
    return experts


REGIME_LOGIT = 8.0  # with several regimes, how much more likely the LM head makes a token of the input's own part


def regime_rows(vocab_size: int, regimes: int) -> list[slice]:
    """The vocabulary cut into `regimes` contiguous parts, each routed by its own expert ranking."""
    return [slice(r * vocab_size // regimes, (r + 1) * vocab_size // regimes) for r in range(regimes)]


def apply_router_skew(state: dict, experts: dict[int, ExpertWeights], config: ModelConfig, skew: float, seed: int,
                      regimes: int = 1):  # fmt: skip
    """The sink dimensions and per-layer ranked router columns described in the module docstring; in place."""
    sqrt_d = math.sqrt(config.hidden_size)
    embed = state["model.embed_tokens.weight"]  # [V, D]
    embed[:, :regimes] = 0.0
    for r, rows in enumerate(regime_rows(config.vocab_size, regimes)):
        embed[rows, r] = sqrt_d
    if "lm_head.weight" in state and not config.tie_word_embeddings:
        lm_head = state["lm_head.weight"]  # [V, D]
        lm_head[:, :regimes] = 0.0
        for r, rows in enumerate(regime_rows(config.vocab_size, regimes) if regimes > 1 else []):
            lm_head[rows, r] = REGIME_LOGIT / math.sqrt(config.hidden_size / 2)  # the normed sink is ~sqrt(D / 2)
    for name, tensor in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor[:regimes, :] = 0.0
        elif name.endswith("o_proj.bias"):
            tensor[:regimes] = 0.0
    for weights in experts.values():
        weights.down[:, :regimes, :] = 0.0
    gen = torch.Generator().manual_seed(seed + 2)
    for layer_idx in config.moe_layer_ids:
        router = state[f"model.layers.{layer_idx}.mlp.gate.weight"]  # [E, D]
        for r in range(regimes):
            rank = torch.randperm(config.num_experts, generator=gen)  # [E]: rank of expert e in regime r
            column = -skew * torch.log(rank.double() + 1.0) / math.sqrt(config.hidden_size / 2)  # [E]
            router[:, r] = column.to(router.device, router.dtype)
