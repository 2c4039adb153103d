"""The linear-attention ops over state pages against Hugging Face's torch paths for Qwen3-Next (the gated delta rule
token by token and chunked, the causal conv1d): outputs and the states left in the pages."""

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

import rimuru.ops  # noqa: F401  (registers the ops)
from rimuru.ops import reference

HK, HV, DK, DV, PAGES = 2, 4, 8, 6, 5


def _delta_inputs(batch: int, tokens: int, seed: int = 0):
    """HF-layout q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv] and initial states [B, Hv, Dk, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, tokens, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(batch, tokens, HV, DV, generator=gen)
    g = -torch.rand(batch, tokens, HV, generator=gen) * 0.5  # log decays <= 0
    beta = torch.rand(batch, tokens, HV, generator=gen)
    state = torch.randn(batch, HV, DK, DV, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _hf_recurrent(q, k, v, g, beta, state):
    return hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)  # fmt: skip


def test_gated_delta_step_matches_hf_token_by_token_and_skips_padding():
    q, k, v, g, beta, state = _delta_inputs(batch=3, tokens=5)
    expected, expected_state = _hf_recurrent(q, k, v, g, beta, state.clone())
    ssm_view = torch.full((PAGES, HV, DK, DV), float("nan"))
    ids = torch.tensor([3, 0, 4])
    ssm_view[ids] = state
    untouched = ssm_view[1].clone()
    padded_ids = torch.tensor([3, 0, -1, 4])  # a padding row between the requests
    for t in range(5):
        pad = lambda x: torch.cat([x[:2, t], torch.zeros_like(x[:1, t]), x[2:, t]])  # noqa: E731
        out = torch.ops.rimuru.gated_delta_step(pad(q), pad(k), pad(v), pad(g), pad(beta), ssm_view, padded_ids)
        torch.testing.assert_close(out[[0, 1, 3]], expected[:, t], rtol=1e-4, atol=1e-5)
        assert (out[2] == 0).all()
    torch.testing.assert_close(ssm_view[ids], expected_state, rtol=1e-4, atol=1e-5)
    assert torch.isnan(ssm_view[1]).all() and torch.isnan(untouched).all()


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_gated_delta_chunk_matches_hf_and_carries_the_state_across_calls(chunk_size):
    q, k, v, g, beta, state = _delta_inputs(batch=1, tokens=11, seed=1)
    expected, expected_state = _hf_recurrent(q, k, v, g, beta, None)
    hf_chunked, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size,
                                                     use_qk_l2norm_in_kernel=True)  # fmt: skip
    torch.testing.assert_close(hf_chunked, expected, rtol=1e-4, atol=1e-5)
    ssm_view = torch.full((PAGES, HV, DK, DV), float("nan"))
    parts = [(0, 6), (6, 7), (7, 11)]  # chunked prefill: the state page carries the sequence between calls
    outs = [reference.gated_delta_chunk(q[0, a:b], k[0, a:b], v[0, a:b], g[0, a:b], beta[0, a:b], ssm_view, 2,
                                        continues=a > 0, chunk_size=chunk_size) for a, b in parts]  # fmt: skip
    torch.testing.assert_close(torch.cat(outs), expected[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ssm_view[2], expected_state[0], rtol=1e-4, atol=1e-5)
    assert torch.isnan(ssm_view[[0, 1, 3, 4]]).all()


def test_gated_delta_prefill_then_steps_equals_hf_over_the_whole_sequence():
    q, k, v, g, beta, _ = _delta_inputs(batch=1, tokens=9, seed=2)
    expected, _ = _hf_recurrent(q, k, v, g, beta, None)
    ssm_view = torch.zeros(PAGES, HV, DK, DV)
    prefill = torch.ops.rimuru.gated_delta_prefill(q[0, :6], k[0, :6], v[0, :6], g[0, :6], beta[0, :6], ssm_view,
                                                   torch.tensor([1]), _starts(6), torch.tensor([False]))  # fmt: skip
    decode = [torch.ops.rimuru.gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], ssm_view,
                                                torch.tensor([1])) for t in range(6, 9)]  # fmt: skip
    torch.testing.assert_close(torch.cat([prefill, *decode]), expected[0], rtol=1e-4, atol=1e-5)


def _starts(num_tokens: int) -> torch.Tensor:
    """`query_start_loc` of a packed batch of one request's chunk of `num_tokens`."""
    return torch.tensor([0, num_tokens], dtype=torch.int32)


def test_causal_conv1d_matches_hf_prefill_then_decode():
    channels, width, tokens = 6, 4, 7
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, channels, tokens, generator=gen)
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    expected = hf.causal_conv1d_fn(x, weight, bias, activation="silu")  # [1, C, T]
    conv_view = torch.full((PAGES, channels, width - 1), float("nan"))
    prefill = [torch.ops.rimuru.causal_conv1d_prefill(x[0, :, a:b].T, conv_view, torch.tensor([4]), _starts(b - a),
                                                      torch.tensor([a > 0]), weight, bias)
               for a, b in [(0, 2), (2, 5)]]  # a chunk shorter than the kernel's history  # fmt: skip
    decode = [torch.ops.rimuru.causal_conv1d_step(x[0, :, t:t + 1].T, conv_view, torch.tensor([4]), weight, bias)
              for t in range(5, tokens)]  # fmt: skip
    torch.testing.assert_close(torch.cat([*prefill, *decode]), expected[0].T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv_view[4], x[0, :, -(width - 1):])
    assert torch.isnan(conv_view[:4]).all()


def test_opcheck_linear_attention_ops():
    q, k, v, g, beta, state = _delta_inputs(batch=2, tokens=3)
    ssm_view = torch.zeros(PAGES, HV, DK, DV)
    ssm_view[[1, 3]] = state
    torch.library.opcheck(torch.ops.rimuru.gated_delta_step.default,
                          (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], ssm_view, torch.tensor([1, 3])))  # fmt: skip
    conv_view = torch.randn(PAGES, 6, 3)
    weight, bias = torch.randn(6, 4), torch.randn(6)
    torch.library.opcheck(torch.ops.rimuru.causal_conv1d_step.default,
                          (torch.randn(2, 6), conv_view, torch.tensor([0, 2]), weight, bias))  # fmt: skip


def _linear_layer_step(x, conv_view, ssm_view, ids, weight, q, k, v, g, beta):
    mixed = torch.ops.rimuru.causal_conv1d_step(x, conv_view, ids, weight, None)
    return mixed.sum() + torch.ops.rimuru.gated_delta_step(q, k, v, g, beta, ssm_view, ids).sum()


def test_compile_fullgraph_traces_the_linear_attention_ops():
    q, k, v, g, beta, state = _delta_inputs(batch=2, tokens=1)
    ids = torch.tensor([0, 2])
    views = lambda: (torch.ones(PAGES, 6, 3), torch.zeros(PAGES, HV, DK, DV))  # noqa: E731
    args = (torch.randn(2, 6), torch.randn(6, 4), q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    conv, ssm = views()
    expected = _linear_layer_step(args[0], conv, ssm, ids, *args[1:])
    conv2, ssm2 = views()
    compiled = torch.compile(_linear_layer_step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(args[0], conv2, ssm2, ids, *args[1:]), expected)
    torch.testing.assert_close(ssm2, ssm)
    torch.testing.assert_close(conv2, conv)


def _packed_batch(lengths, channels=6, width=4, seed=0):
    """A packed batch of prompt chunks of `lengths` tokens: conv inputs, pages, state ids and which continue."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), channels, generator=gen)
    conv_view = torch.randn(PAGES, channels, width - 1, generator=gen)
    starts = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    ids = torch.randperm(PAGES, generator=gen)[: len(lengths)]
    continues = torch.tensor([i % 2 == 0 for i in range(len(lengths))])
    return x, conv_view, ids, starts, continues, torch.randn(channels, width, generator=gen)


def test_a_new_requests_conv_ignores_the_nan_its_page_held():
    """A page freed by an expert or an earlier request may hold NaN bit patterns; a request that starts there reads
    zeros, never the page (a product by zero would keep the NaN)."""
    from rimuru.ops.linear_attention import causal_conv1d_prefill_gathered

    x, conv_view, ids, starts, continues, weight = _packed_batch([5, 1, 2])
    conv_view[ids[~continues]] = float("nan")
    ref_view, view = conv_view.clone(), conv_view.clone()
    ref = reference.causal_conv1d_prefill(x, ref_view, ids, starts, continues, weight, None)
    out = causal_conv1d_prefill_gathered(x, view, ids, starts, continues, weight, None)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [[1], [5, 1, 2], [3, 7, 1, 4]])
def test_causal_conv1d_prefill_gathers_what_the_chunks_compute(lengths):
    """The GPU form of the packed conv (`causal_conv1d_prefill_gathered`: no loop over requests) against the
    reference, which runs the chunk op request by request; chunks shorter than the kernel keep part of the old
    history."""
    from rimuru.ops.linear_attention import causal_conv1d_prefill_gathered

    x, conv_view, ids, starts, continues, weight = _packed_batch(lengths)
    bias = torch.randn(x.shape[1])
    ref_view, view = conv_view.clone(), conv_view.clone()
    ref = reference.causal_conv1d_prefill(x, ref_view, ids, starts, continues, weight, bias)
    out = causal_conv1d_prefill_gathered(x, view, ids, starts, continues, weight, bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(view, ref_view, rtol=0, atol=0)


def test_packed_prefill_ops_equal_the_chunk_ops_request_by_request():
    lengths = [3, 1, 6]
    x, conv_view, ids, starts, continues, weight = _packed_batch(lengths)
    q, k, v, g, beta, state = _delta_inputs(batch=1, tokens=sum(lengths))
    q, k, v, g, beta = (t[0] for t in (q, k, v, g, beta))
    ssm_view = torch.randn(PAGES, HV, DK, DV)
    ssm_ref, conv_ref = ssm_view.clone(), conv_view.clone()
    out = torch.ops.rimuru.gated_delta_prefill(q, k, v, g, beta, ssm_view, ids, starts, continues)
    mixed = torch.ops.rimuru.causal_conv1d_prefill(x, conv_view, ids, starts, continues, weight, None)
    for r, (s, e) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        i, c = int(ids[r]), bool(continues[r])
        torch.testing.assert_close(out[s:e], reference.gated_delta_chunk(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                                                         ssm_ref, i, c))  # fmt: skip
        torch.testing.assert_close(mixed[s:e], reference.causal_conv1d_chunk(x[s:e], conv_ref, i, c, weight, None))
    torch.testing.assert_close(ssm_view, ssm_ref)
    torch.testing.assert_close(conv_view, conv_ref)
    torch.library.opcheck(torch.ops.rimuru.gated_delta_prefill.default,
                          (q, k, v, g, beta, ssm_view, ids, starts, continues))  # fmt: skip
    torch.library.opcheck(torch.ops.rimuru.causal_conv1d_prefill.default,
                          (x, conv_view, ids, starts, continues, weight, None))  # fmt: skip


def test_a_prompt_cut_at_the_blocks_rounds_as_if_uncut():
    """Cut at multiples of DELTA_RULE_BLOCK from its first token (where the scheduler cuts a hybrid's prompts), a
    prompt's delta rule gives the uncut chunk's outputs and state bit for bit."""
    q, k, v, g, beta, _ = _delta_inputs(batch=1, tokens=150, seed=3)
    block = reference.DELTA_RULE_BLOCK
    results = []
    for parts in ([(0, 150)], [(0, block), (block, 2 * block), (2 * block, 150)]):
        ssm_view = torch.zeros(PAGES, HV, DK, DV)
        outs = [reference.gated_delta_chunk(q[0, a:b], k[0, a:b], v[0, a:b], g[0, a:b], beta[0, a:b], ssm_view, 1,
                                            continues=a > 0) for a, b in parts]  # fmt: skip
        results.append((torch.cat(outs), ssm_view[1].clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_every_layer_hands_flash_linear_attention_the_same_sequence_starts(monkeypatch):
    """fla caches its chunk indices by the identity of `cu_seqlens` (reading the lengths on the host costs a sync):
    the packed prefill passes the pass's `query_start_loc` on as it is, so each linear layer after the first hits
    that cache. A stand-in for fla's kernel records what it was given."""
    from rimuru.ops import linear_attention

    seen = []

    def chunk_rule(q, k, v, g, beta, initial_state, cu_seqlens, **_):
        seen.append(cu_seqlens)
        return torch.zeros_like(v), initial_state

    monkeypatch.setattr(linear_attention, "_fla_chunk_gated_delta_rule", lambda: chunk_rule)
    q, k, v, g, beta, _ = (t[0] for t in _delta_inputs(batch=1, tokens=5))
    starts, ids = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([1, 3])
    ssm_view = torch.zeros(PAGES, HV, DK, DV)
    for _ in range(2):  # two linear layers of one pass
        linear_attention.gated_delta_prefill_fla(q, k, v, g, beta, ssm_view, ids, starts, torch.tensor([True, False]))
    assert seen[0] is starts and seen[1] is starts
