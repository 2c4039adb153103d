"""How many experts a decode step touches under vLLM's dummy weights (every tensor uniform in +-1e-3), on the CPU:
a shortened copy of a config (its width, heads and router; fewer layers, small experts), the stream's first B
prompts cut to one length, greedy decode, the distinct experts of B tokens' top-k choices a layer and step. Whether
vLLM's `--load-format dummy` routes a batch to fewer experts than Rimuru's flat random weights (docs/benchmarks/vs-vllm.md).

    python tools/vs_vllm/dummy_routing.py .bench/qwen3-30b-a3b --stream .bench/stream-400-r10.jsonl --batch 16
"""

import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def shortened_model(config_dir: str, layers: int) -> tuple[torch.nn.Module, object]:
    config = AutoConfig.from_pretrained(config_dir)
    config.num_hidden_layers, config.moe_intermediate_size = layers, 64  # routing needs the router, not the experts
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.uniform_(-1e-3, 1e-3)  # vLLM's initialize_dummy_weights
    return model, config


def record_choices(model: torch.nn.Module, config) -> list[torch.Tensor]:
    """A list each router call appends its tokens' top-k experts to."""
    chosen: list[torch.Tensor] = []

    def hook(module, args, out):
        outs = out if isinstance(out, tuple) else (out,)
        logits = next(o for o in outs if torch.is_tensor(o) and o.shape[-1] == config.num_experts)
        chosen.append(logits.float().topk(config.num_experts_per_tok, dim=-1).indices)

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(hook)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config_dir")
    parser.add_argument("--stream", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, config = shortened_model(args.config_dir, args.layers)
    chosen = record_choices(model, config)
    with open(args.stream) as f:
        prompts = [r["prompt_token_ids"][: args.prompt_tokens] for r in map(json.loads, f)
                   if len(r["prompt_token_ids"]) >= args.prompt_tokens][: args.batch]  # fmt: skip
    with torch.no_grad():
        out = model(torch.tensor(prompts), use_cache=True)
        for step in range(args.steps):
            tokens = out.logits[:, -1].argmax(-1)
            chosen.clear()
            out = model(tokens[:, None], past_key_values=out.past_key_values, use_cache=True)
            touched = [len(torch.unique(c)) for c in chosen]
            print(f"step {step}: {len(torch.unique(tokens))} distinct tokens of {args.batch}; "
                  f"experts touched a layer {touched} of {config.num_experts}")  # fmt: skip


if __name__ == "__main__":
    main()
