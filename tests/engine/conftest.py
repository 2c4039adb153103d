"""Fabricated checkpoints of both families and Hugging Face's greedy outputs on them, computed once a session."""

import functools
import gc
import random
import sys

import pytest
import torch
import transformers

import rimuru.engine
from rimuru.admission import GrowthForecast
from rimuru.memory_profile import profile_step_memory
from rimuru.models import fabricate

NUM_PROMPTS, MAX_TOKENS = 9, 12


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 5, 8, 13, 17, 24, 31, 40][:NUM_PROMPTS]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


# a GPU run may pick the other token where Hugging Face's two best logits lie this close (fp32 sums in another
# order, flash-linear-attention's TF32 products); from there on its tokens are not comparable
NEAR_TIE_LOGITS = 0.05


@functools.cache
def hf_model(folder: str) -> torch.nn.Module:
    """Hugging Face transformers' model of a checkpoint, fp32 on CPU, its torch kernels."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    use_torch_kernels(model)
    return model


def hf_greedy(folder: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Hugging Face transformers' greedy `generate`, fp32 on CPU, one prompt at a time, EOS ignored."""
    model = hf_model(folder)
    model.generation_config.eos_token_id = None  # else generate takes the checkpoint's EOS back and stops there
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = model.generate(torch.tensor([prompt]), generation_config=config, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            outputs.append(tokens[0, len(prompt) :].tolist())
    return outputs


def assert_greedy_close(reference: str, prompts, tokens, expected) -> None:
    """`tokens` equal Hugging Face's greedy `expected` up to a position where its two best logits were a near tie
    (`NEAR_TIE_LOGITS`) and the run took the other one; the rest of that sequence is not compared. For GPU runs."""
    assert len(tokens) == len(expected)
    for prompt, ours, theirs in zip(prompts, tokens, expected):
        assert len(ours) == len(theirs)
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if at is None:
            continue
        with torch.no_grad():
            logits = hf_model(reference)(torch.tensor([prompt + theirs[:at]])).logits[0, -1]
        margin = (logits[theirs[at]] - logits[ours[at]]).item()
        assert margin < NEAR_TIE_LOGITS, f"token {at} of prompt {prompts.index(prompt)}: {ours[at]} where Hugging "\
            f"Face's {theirs[at]} led by {margin:.4f}"


def use_torch_kernels(model: torch.nn.Module) -> None:
    """The model's module calls transformers' torch functions, not their flash-linear-attention stand-ins: where
    that is installed, transformers before 5.25 hands it CPU tensors its GPU kernels cannot read."""
    module = sys.modules[type(model).__module__]
    for name, value in list(vars(module).items()):
        if name.startswith("torch_") and callable(value) and hasattr(value, "__wrapped__"):
            setattr(module, name, value.__wrapped__)


@pytest.fixture(scope="session", params=["qwen2_moe", "qwen3_moe"])
def family(request, tmp_path_factory):
    """(checkpoint folder, prompts, Hugging Face's greedy outputs) for one family."""
    arch = request.param
    folder = fabricate(tmp_path_factory.mktemp(arch), arch=arch, mlp_only_layers=(1,) if arch == "qwen2_moe" else ())
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(folder).vocab_size)
    return folder, prompts, hf_greedy(folder, prompts, MAX_TOKENS)


def free_gpu_memory() -> None:
    """Give the engines no test holds any more back to the GPU: an engine's reference cycles outlive its last name,
    and one that kept the whole card would leave the next engine too little (the GPU tests build several)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _free_gpu_memory_after_each_test():
    yield
    if torch.cuda.is_available():
        free_gpu_memory()


def pin_step_reserve(monkeypatch) -> None:
    """Every engine of the test gets the step memory its first engine profiled: the profile's reserved bytes move
    by an allocator block from one engine to the next, and a tiny model's budget for 60 KV tokens has less room than
    that. The tiny model's steps take a few MiB, well inside the profile's margin, whatever their shape."""
    first = []

    def profiled_once(*args, **kwargs):
        if not first:
            first.append(profile_step_memory(*args, **kwargs))
        return first[0]

    monkeypatch.setattr(rimuru.engine, "profile_step_memory", profiled_once)


def expect_no_growth(monkeypatch) -> None:
    """Make the scheduler's growth forecast expect no request to grow: a request is admitted when its prompt fits
    today, so a tight pool runs dry as the batch decodes and preempts (the path these tests check)."""
    monkeypatch.setattr(GrowthForecast, "remaining", lambda self, request: 0)
