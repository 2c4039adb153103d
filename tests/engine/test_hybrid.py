"""The hybrid models through the engine (Qwen3-Next with one tensor an expert, and Qwen3.5 from its composite
checkpoint with fused experts: Gated DeltaNet layers on each side of gated attention): greedy tokens equal Hugging Face's under every memory policy, across prompt
chunks and through preemption, and each request's state pages are taken at admission and given back when it
ends."""

import pytest
import torch
import transformers

from rimuru import LLM
from rimuru.memory import CONV, SSM
from rimuru.models import fabricate
from tests.engine.conftest import MAX_TOKENS, assert_greedy_close, expect_no_growth, hf_greedy, make_prompts
from tests.engine.test_experts import GREEDY

HF_CHECKPOINT = {}  # a fabricated checkpoint -> the one transformers reads for it (Qwen3.5's text model)


# each family in the expert layout its published checkpoints use: one tensor an expert, and fused
LAYOUTS = {"qwen3_next": "per_expert", "qwen3_5_moe": "fused"}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def hybrid(request, tmp_path_factory):
    """(checkpoint folder, prompts, Hugging Face's greedy outputs) of a tiny hybrid; for Qwen3.5's composite
    checkpoint, transformers' text model on the same weights."""
    arch = request.param
    layout = LAYOUTS[arch]
    folder = fabricate(tmp_path_factory.mktemp(arch), arch=arch, expert_layout=layout)
    reference = folder
    if arch == "qwen3_5_moe":
        reference = fabricate(tmp_path_factory.mktemp("text"), arch="qwen3_5_moe_text", expert_layout=layout)
    HF_CHECKPOINT[folder] = reference
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(reference).vocab_size)
    return folder, prompts, hf_greedy(reference, prompts, MAX_TOKENS)


def hybrid_budget(folder: str, kv_tokens: int, num_states: int, offload: int, **options) -> int:
    """Room for two loading buffers of `offload` experts, every expert, KV for `kv_tokens` tokens in each attention
    layer and the linear-attention state of `num_states` requests, beside the step reserve of an engine of
    `options`."""
    engine = LLM(folder, progress=False, expert_policy="resident", **options).engine
    plan, sizes, config = engine.memory_plan, engine.pool.sizes, engine.model_config
    kv_pages = -(-kv_tokens // sizes.page_tokens) * len(config.attention_layer_ids)
    pages = (engine.experts.num_expert_pages + 2 * offload * 3 + -(-kv_pages // sizes.kv_pages_per_expert_page)
             + num_states * engine.states.expert_pages_per_request())  # fmt: skip
    engine.close()  # and a tensor parallel engine's other ranks
    return plan.weights_bytes + plan.activation_bytes + pages * sizes.expert_page_bytes


def generate(folder: str, prompts, **options):
    """(engine, greedy tokens); every state page given back at the end."""
    llm = LLM(folder, progress=False, **options)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    engine = llm.engine
    engine.allocator.check_integrity()
    assert engine.allocator.num_used_pages(SSM) == engine.allocator.num_used_pages(CONV) == 0
    return engine, tokens


def test_hybrid_tokens_equal_hugging_face_under_every_policy(hybrid):
    folder, prompts, expected = hybrid
    resident, tokens = generate(folder, prompts, expert_policy="resident")
    assert tokens == expected and resident.peak_running > 1  # a batch of states, not one request at a time
    budget = hybrid_budget(folder, kv_tokens=60, num_states=3, offload=2)
    fixed, tokens = generate(folder, prompts, gpu_memory_budget=budget, expert_policy="fixed", offload_per_layer=2)
    assert tokens == expected and fixed.experts.num_offloaded > 0
    elastic, tokens = generate(folder, prompts, gpu_memory_budget=budget, expert_offload_limit=3, adjuster="paper")
    assert tokens == expected and elastic.expert_stats["evictions"] > 0


def test_hybrid_prompt_chunks_carry_the_state_exactly(hybrid):
    """Prompts of up to 40 tokens in chunks of at most 8 tokens a step: each chunk starts from the state the last
    one left in the request's pages."""
    folder, prompts, expected = hybrid
    engine, tokens = generate(folder, prompts, expert_policy="resident", max_num_batched_tokens=8, max_num_seqs=4)
    assert tokens == expected
    assert engine.num_steps > sum(-(-len(p) // 8) for p in prompts) // 4  # prompts took several steps


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_hybrid_preemption_keeps_the_state(hybrid, monkeypatch, preemption):
    """Admitted on today's pages, the batch outgrows a pool with room for two states: preempted requests give
    their state back, copied to the host with their KV and back into fresh pages, or rebuilt from their tokens."""
    folder, prompts, expected = hybrid
    expect_no_growth(monkeypatch)
    budget = hybrid_budget(folder, kv_tokens=48, num_states=2, offload=0)
    engine, tokens = generate(folder, prompts, gpu_memory_budget=budget, expert_policy="resident",
                              preemption=preemption)  # fmt: skip
    swap = engine.scheduler.swap
    assert engine.scheduler.num_preemptions > 0
    assert (swap.num_saved > 0 and swap.saved_bytes == 0) if preemption == "swap" else swap is None
    assert tokens == expected


@pytest.mark.parametrize("max_num_batched_tokens", [8, 64])
def test_hybrid_decode_steps_replay_graphs_and_give_the_eager_tokens(hybrid, max_num_batched_tokens):
    """cuda_graphs on the CPU: decode steps take the padded graph path (state ids -1 on the padding rows, which the
    kernels skip), steps with prompt chunks run eagerly; Hugging Face's tokens either way."""
    folder, prompts, expected = hybrid
    engine, tokens = generate(folder, prompts, expert_policy="resident", cuda_graphs=True, max_num_seqs=8,
                              max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
    assert tokens == expected
    assert 0 < engine.runner.num_graph_steps < engine.num_steps


def test_hybrid_graphs_under_the_elastic_pool_give_the_eager_tokens(hybrid):
    folder, prompts, expected = hybrid
    options = dict(cuda_graphs=True, max_num_seqs=8, max_num_batched_tokens=64)
    budget = hybrid_budget(folder, kv_tokens=60, num_states=3, offload=2, **options)
    elastic, tokens = generate(folder, prompts, gpu_memory_budget=budget, expert_offload_limit=3, adjuster="paper",
                               **options)  # fmt: skip
    assert tokens == expected and elastic.expert_stats["evictions"] > 0 and elastic.runner.num_graph_steps > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hybrid_tokens_on_gpu_equal_hugging_face(hybrid, monkeypatch):
    """fp32 on the GPU (the decode steps' Triton kernels over the state pages, eager steps): Hugging Face's tokens,
    all experts resident and under the elastic pool, and through preemption."""
    folder, prompts, expected = hybrid
    options = dict(device="cuda", dtype=torch.float32)
    _, resident = generate(folder, prompts, expert_policy="resident", **options)
    assert_greedy_close(HF_CHECKPOINT[folder], prompts, resident, expected)
    budget = hybrid_budget(folder, kv_tokens=60, num_states=3, offload=2, **options)  # fp32 weights, not bf16
    elastic, tokens = generate(folder, prompts, gpu_memory_budget=budget, expert_offload_limit=3, adjuster="paper",
                               **options)  # fmt: skip
    assert_greedy_close(HF_CHECKPOINT[folder], prompts, tokens, expected)
    assert elastic.expert_stats["evictions"] > 0
    expect_no_growth(monkeypatch)
    longest = max(map(len, prompts)) + MAX_TOKENS  # a pool sized to the page holds no more than the longest request
    options["cuda_graphs"] = False  # the graphs' scratch page and a state's whole huge page leave no squeeze that fits
    squeezed, tokens = generate(folder, prompts, gpu_memory_budget=hybrid_budget(folder, longest, 2, 0, **options),
                                expert_policy="resident", **options)  # fmt: skip
    assert_greedy_close(HF_CHECKPOINT[folder], prompts, tokens, expected)
    assert squeezed.scheduler.num_preemptions > 0


def test_a_running_hybrid_request_shows_its_state_in_the_pool_split(hybrid):
    """What /metrics and the dashboard draw: a running request's SSM and conv pages as the state kind."""
    from rimuru.serving.timeline import pool_split

    folder, prompts, _ = hybrid
    engine = LLM(folder, progress=False, expert_policy="resident").engine
    engine.add_request("r", prompts[3], GREEDY)
    engine.step()
    split = pool_split(engine.allocator.stats())
    layers = len(engine.model_config.linear_layer_ids)
    assert split["state_pages"] == 2 * layers and split["state_bytes"] > 0


def test_hybrid_prompts_are_cut_at_the_delta_rules_blocks(hybrid):
    """Prompts of 150 tokens under a step limit of 100 with a decode beside them: each prompt chunk ends at a
    multiple of the block from the prompt's first token, or at the prompt's end."""
    from rimuru.ops.reference import DELTA_RULE_BLOCK

    folder, prompts, _ = hybrid
    engine = LLM(folder, progress=False, expert_policy="resident", max_num_batched_tokens=100).engine
    engine.add_request("short", prompts[0], GREEDY)
    long_prompts = {f"long-{i}": [(7 * i + j) % 400 + 3 for j in range(150)] for i in range(3)}
    for request_id, prompt in long_prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    ends = set()
    while engine.has_unfinished():
        engine.step()
        ends |= {r.num_computed_tokens for r in engine.requests.values()
                 if r.request_id in long_prompts and r.num_computed_tokens <= 150}  # fmt: skip
    assert ends - {0, 150} and all(end % DELTA_RULE_BLOCK == 0 for end in ends - {150}), sorted(ends)
