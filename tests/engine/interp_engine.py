"""The engine with every `rimuru::` op's GPU kernel (Triton, and the GPU paths around it) in place of its CPU one,
run by the Triton interpreter on CPU tensors in fp32: Hugging Face's greedy tokens with some experts on the host
(read in place by the expert kernel, on the graphs' padded path), for Qwen1.5-MoE and Qwen3.5. It catches what the kernels' own tests cannot: the views, strides and tables the engine hands them.

Run by `test_interpreted_engine.py` in a subprocess with TRITON_INTERPRET=1 (read when a kernel is decorated).
By hand: `TRITON_INTERPRET=1 python -P -m pytest tests/engine/interp_engine.py`.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton kernels are defined", allow_module_level=True)

from torch._library.custom_ops import OPDEFS  # noqa: E402

import rimuru.ops  # noqa: E402, F401  (registers the ops)
from tests.engine import test_hybrid  # noqa: E402
from tests.engine.test_experts import budget_for, run  # noqa: E402

hybrid, hybrid_budget = test_hybrid.hybrid, test_hybrid.hybrid_budget  # the fixture, and its budget rule


def gpu_kernels_on_the_cpu() -> list[str]:
    """Each rimuru op's CUDA kernel registered as its CPU kernel too; the ops swapped."""
    swapped = []
    for name, op in OPDEFS.items():
        if name.startswith("rimuru::") and "cuda" in op._backend_fns:
            op.register_kernel("cpu")(op._backend_fns["cuda"])
            swapped.append(name)
    return swapped


SWAPPED = gpu_kernels_on_the_cpu()


def every_other(checkpoint):
    """(folder, every other prompt, their expected tokens): prompts of 1 to 40 tokens, at half the interpreter's time."""
    folder, prompts, expected = checkpoint
    return folder, prompts[::2], expected[::2]


def test_every_op_with_a_gpu_kernel_is_swapped():
    assert {"rimuru::paged_moe", "rimuru::paged_attention", "rimuru::write_kv", "rimuru::gated_delta_step",
            "rimuru::causal_conv1d_step"} <= set(SWAPPED)  # fmt: skip


# qwen2_moe: the shared expert's ops beside what every family runs; the fixed offload puts some experts on the host,
# so the pass reads pages and host memory alike
@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)
def test_gpu_kernels_give_hugging_face_tokens(family):
    folder, prompts, expected = every_other(family)
    budget = budget_for(folder, kv_tokens=60, offload=3)
    fixed, tokens = run(folder, prompts, gpu_memory_budget=budget, expert_policy="fixed", offload_per_layer=3,
                        cuda_graphs=True)  # fmt: skip
    assert tokens == expected and fixed.expert_stats["direct_reads"] > 0


@pytest.mark.parametrize("hybrid", ["qwen3_5_moe"], indirect=True)
def test_gpu_kernels_give_hugging_face_tokens_for_a_hybrid(hybrid):
    folder, prompts, expected = every_other(hybrid)
    budget = hybrid_budget(folder, kv_tokens=60, num_states=3, offload=2)
    fixed, tokens = run(folder, prompts, gpu_memory_budget=budget, expert_policy="fixed", offload_per_layer=2,
                        cuda_graphs=True)  # fmt: skip
    assert tokens == expected and fixed.expert_stats["direct_reads"] > 0
