"""Where the engine's greedy tokens leave Hugging Face's on a test's fabricated checkpoint, and by what margin.

    python -m tools.engine.divergence --arch qwen3_5_moe --device cuda [--compile] [--policy resident]

The tests' prompts and checkpoint (tests/engine/conftest.py), transformers fp32 on the CPU as the reference. For
each prompt whose tokens differ: the first differing position, transformers' two best logits there and the
engine's two best log-probabilities. A margin of a few hundredths is a near tie that any rounding turns; a wide one
is a bug.
"""

import argparse
import tempfile

import torch
import transformers

from rimuru import LLM, SamplingParams
from rimuru.models import fabricate
from tests.engine.conftest import MAX_TOKENS, make_prompts, use_torch_kernels


def reference(folder: str, prompts: list[list[int]]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy tokens and each step's logits, one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    use_torch_kernels(model)
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None,
                                           pad_token_id=0, output_scores=True, return_dict_in_generate=True)  # fmt: skip
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), generation_config=config,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))  # fmt: skip
            outputs.append((out.sequences[0, len(prompt) :].tolist(), [s[0] for s in out.scores]))
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_5_moe")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--policy", default="resident")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mlp_only = (1,) if args.arch == "qwen2_moe" else ()
        folder = str(fabricate(f"{tmp}/model", arch=args.arch, mlp_only_layers=mlp_only))
        text = args.arch == "qwen3_5_moe"  # the composite checkpoint's reference is the text model on its weights
        ref_folder = str(fabricate(f"{tmp}/text", arch="qwen3_5_moe_text")) if text else folder
        prompts = make_prompts(transformers.AutoConfig.from_pretrained(ref_folder).vocab_size)
        expected = reference(ref_folder, prompts)
        llm = LLM(folder, progress=False, device=args.device, dtype=torch.float32, expert_policy=args.policy,
                  compile=args.compile)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    differing = 0
    for i, ((tokens, scores), got) in enumerate(zip(expected, outputs)):
        at = next((j for j, (a, b) in enumerate(zip(tokens, got.token_ids)) if a != b), None)
        if at is None:
            continue
        differing += 1
        top = scores[at].topk(2)
        mine = sorted(got.logprobs[at].items(), key=lambda kv: -kv[1])[:2]
        print(f"prompt {i} ({len(prompts[i])} tokens), token {at}: transformers {top.indices.tolist()} margin "
              f"{float(top.values[0] - top.values[1]):.4f}; engine {[t for t, _ in mine]} margin "
              f"{mine[0][1] - mine[1][1]:.4f}")  # fmt: skip
    print(f"{differing} of {len(prompts)} prompts differ ({args.arch}, {args.device}, {args.policy}, "
          f"compile={args.compile})")


if __name__ == "__main__":
    main()
