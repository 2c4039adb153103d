"""The `rimuru::` ops on CUDA (Triton kernels) against the fp32 references: bf16, fresh random inputs, poisoned
outputs, relative error under 1e-2."""

import pytest
import torch
from ops_cases import MIXED_BATCH, attention_case, moe_case, runs_in_pair_order

import rimuru.ops as ops
from rimuru.ops import reference

pytestmark = pytest.mark.gpu


def poison_allocator():
    """Fill freed blocks of the caching allocator with NaN so an output element nobody writes shows up."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


def rel_err(tri, ref):
    assert torch.isfinite(tri).all(), "unwritten or poisoned output element"
    return ((tri.float() - ref.float()).norm() / ref.float().norm()).item()


def as_fp32(args):
    return [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,num_features,hidden_size", [
    (1, 128, 8, 768, 512), (5, 60, 4, 1408, 256), (300, 128, 8, 768, 512), (1000, 60, 4, 200, 136),
    (17, 4, 1, 40, 72),
])
@pytest.mark.parametrize("identity", [False, True])
def test_paged_moe_bf16(num_tokens, num_experts, top_k, num_features, hidden_size, identity):
    seed = int(torch.randint(0, 1 << 30, ()))
    case = moe_case(num_tokens, num_experts, top_k, num_features, hidden_size, torch.bfloat16, "cuda", seed,
                    identity=identity)
    ref = reference.paged_moe(*as_fp32(case.args()))
    poison_allocator()
    tri = ops.paged_moe(*case.args())
    assert tri.dtype == torch.bfloat16 and rel_err(tri, ref) < 1e-2


@pytest.mark.parametrize("num_tokens,extra", [(4, {"PAIR_BLOCKS": True}), (700, {"GROUP_M": 8, "DOWN_GROUP_M": 3})])
def test_paged_moe_tuned_layouts_bf16(num_tokens, extra):
    """The tuned table's layout keys compiled for the GPU: one M block a pair for a few tokens, grouped program
    orders for many (Qwen3-30B-A3B's expert shape, half its hidden size)."""
    from rimuru.ops.configs import moe_config
    from rimuru.ops.paged_moe import paged_moe_triton

    seed = int(torch.randint(0, 1 << 30, ()))
    case = moe_case(num_tokens, 128, 8, 768, 1024, torch.bfloat16, "cuda", seed)
    ref = reference.paged_moe(*as_fp32(case.args()))
    cfg = {**moe_config(num_tokens, 128, 768, 1024, 8, "cuda"), **extra}
    poison_allocator()
    assert rel_err(paged_moe_triton(*case.args(), config=cfg), ref) < 1e-2


def assert_equal_eager_and_replayed(op, expected):
    """`op()` gives exactly `expected` called eagerly, and replayed three times from a CUDA graph into an output
    poisoned before each replay (what the call zeroes or counts inside the graph must start afresh each time)."""
    poison_allocator()
    assert torch.equal(op(), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, expected)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 4, 128), (8, 8, 64), (16, 2, 128)])
@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_paged_attention_bf16(num_heads, num_kv_heads, head_dim, batch):
    seed = int(torch.randint(0, 1 << 30, ()))
    requests = MIXED_BATCH + [(300, 45)] if batch == "mixed" else [(n, 1) for n in (0, 15, 16, 200, 1023, 77)]
    case = attention_case(requests, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, "cuda", seed)
    ref = reference.paged_attention(*as_fp32(case.args()))
    poison_allocator()
    tri = ops.paged_attention(*case.args())
    assert rel_err(tri, ref) < 1e-2


@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 4), (8, 8)])
@pytest.mark.parametrize("num_splits", [None, 2, 5, 64])  # None: the dispatcher's choice
def test_split_kv_decode_bf16(num_heads, num_kv_heads, num_splits):
    from rimuru.ops.paged_attention import attention_config, default_config, paged_attention_triton

    seed = int(torch.randint(0, 1 << 30, ()))
    requests = [(n, 1) for n in (0, 15, 16, 200, 1023, 77, 4000)]
    case = attention_case(requests, num_heads, num_kv_heads, 128, 16, torch.bfloat16, "cuda", seed)
    ref = reference.paged_attention(*as_fp32(case.args()))
    group = num_heads // num_kv_heads
    cfg = attention_config(len(requests), len(requests), group, num_splits) if num_splits else None
    if num_splits is None and num_kv_heads == 4:  # 7 x 4 programs leave most of an H200 idle: it splits
        assert default_config(case.query, case.kv_view, case.page_table, len(requests))["NUM_SPLITS"] > 1
    poison_allocator()  # the split partials come from the allocator too: an unwritten one would read NaN
    tri = paged_attention_triton(*case.args(), config=cfg)
    assert rel_err(tri, ref) < 1e-2


@pytest.mark.parametrize("shape", [(1, 2048), (300, 2048), (77, 32, 128), (5, 136)])
def test_rms_norm_bf16(shape):
    x = torch.randn(*shape, device="cuda").to(torch.bfloat16)
    weight = torch.randn(shape[-1], device="cuda").to(torch.bfloat16)
    ref = reference.rms_norm(x.float(), weight.float(), 1e-6)
    poison_allocator()
    tri = ops.rms_norm(x, weight, 1e-6)
    assert tri.dtype == torch.bfloat16 and rel_err(tri, ref) < 1e-2
    assert (tri.float() - reference.rms_norm(x, weight, 1e-6).float()).abs().max() <= 0.0625  # torch's bf16 form


@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_fused_elementwise_bf16_equal_the_torch_form(num_tokens):
    """The residual add and norm, SwiGLU's activation and the shared expert's gate, bf16 on the GPU: torch's
    roundings kept, so the sums and products equal the torch form's (the sigmoid and silu within a bf16 step)."""
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    x, residual = (torch.randn(2, num_tokens, 2048, device="cuda", generator=gen) * 3).bfloat16().unbind(0)
    weight = torch.randn(2048, device="cuda", generator=gen).bfloat16()
    poison_allocator()
    (ref, ref_sum), (tri, tri_sum) = reference.add_rms_norm(x, residual, weight, 1e-6), ops.add_rms_norm(
        x, residual, weight, 1e-6)  # fmt: skip
    assert torch.equal(tri_sum, ref_sum) and (tri.float() - ref.float()).abs().max() <= 0.0625
    gate_up = (torch.randn(num_tokens, 2 * 1408, device="cuda", generator=gen) * 4).bfloat16()
    for tri, ref in ((ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)),
                     (ops.sigmoid_gated_add(x, gate_up[:, :1], residual),
                      reference.sigmoid_gated_add(x, gate_up[:, :1], residual))):  # fmt: skip
        assert tri.dtype == torch.bfloat16 and rel_err(tri, ref) < 1e-2
        assert (tri.float() - ref.float()).abs().le(ref.float().abs() * 2**-7 + 1e-3).all()


@pytest.mark.parametrize("num_tokens,num_q_heads,num_k_heads", [(1, 32, 4), (77, 32, 4), (2048, 16, 16)])
@pytest.mark.parametrize("norms", [False, True])
def test_rope_write_kv_bf16_equals_the_unfused_ops(num_tokens, num_q_heads, num_k_heads, norms):
    """The fused kernel against the unfused chain (the q/k norm kernel, transformers' bf16 RoPE, the cache write), bf16
    on the GPU: bit for bit without norms (each rotary product rounded before the sum); with them within the norms'
    own reduction-order differences, and near the fp32 reference."""
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    width = (num_q_heads + 2 * num_k_heads) * 128
    qkv = torch.randn(num_tokens, width, device="cuda", generator=gen).bfloat16()
    weights = tuple(torch.randn(2, 128, device="cuda", generator=gen).bfloat16()) if norms else (None, None)
    angles = torch.rand(num_tokens, 64, device="cuda", generator=gen).repeat(1, 2) * 1000
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    kv_view = torch.randn(num_tokens + 7, 2, 16, num_k_heads, 128, device="cuda", generator=gen).bfloat16()
    slots = torch.randperm(kv_view.shape[0] * 16, device="cuda", generator=gen)[:num_tokens]
    slots[::5] = -1
    q, k, v = qkv.unflatten(-1, (num_q_heads + 2 * num_k_heads, 128)).split((num_q_heads, num_k_heads, num_k_heads), 1)
    if norms:
        q, k = ops.rms_norm(q, weights[0], 1e-6), ops.rms_norm(k, weights[1], 1e-6)
    q, k = reference.rope(q, k, cos, sin)  # transformers' bf16 form
    expected = kv_view.clone()
    ops.write_kv(k, v, expected, slots)
    poison_allocator()
    fused = ops.rope_write_kv(qkv, *weights, 1e-6, cos, sin, kv_view, slots, num_q_heads, num_k_heads)
    if not norms:
        assert torch.equal(fused, q) and torch.equal(kv_view, expected)
        return
    ref_pool = kv_view.float().clone()
    ref = reference.rope_write_kv(qkv.float(), *(w.float() for w in weights), 1e-6, cos.float(), sin.float(),
                                  ref_pool, slots, num_q_heads, num_k_heads)  # fmt: skip
    assert rel_err(fused, ref) < 1e-2 and rel_err(kv_view, ref_pool) < 1e-2
    assert (fused == q).float().mean() > 0.99 and (kv_view == expected).float().mean() > 0.99


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize", [(1, 60, 4, False), (2048, 128, 8, True),
                                                                      (33, 512, 10, True)])
def test_topk_softmax_matches_torch(num_tokens, num_experts, top_k, renormalize):
    logits = torch.randn(num_tokens, num_experts, device="cuda") * 3
    padding = torch.rand(num_tokens, device="cuda") < 0.3
    for rows in (None, padding):
        ids, weights = ops.topk_softmax(logits, top_k, renormalize, rows)
        ref_ids, ref_weights = reference.topk_softmax(logits, top_k, renormalize, rows)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def test_write_kv_bf16_exact():
    case = attention_case([(0, 0)], 4, 4, 128, 16, torch.bfloat16, "cuda", spare_pages=8)
    key, value = torch.randn(2, 40, 4, 128, device="cuda", dtype=torch.bfloat16).unbind(0)
    slots = torch.randperm(8 * 16, device="cuda")[:40]
    slots[::7] = -1
    expected = case.kv_view.clone()
    reference.write_kv(key, value, expected, slots)
    ops.write_kv(key, value, case.kv_view, slots)
    torch.testing.assert_close(case.kv_view, expected, equal_nan=True, rtol=0, atol=0)


def test_opcheck_cuda():
    moe = moe_case(9, 6, 2, 64, 96, torch.bfloat16, "cuda", identity=True)
    torch.library.opcheck(torch.ops.rimuru.paged_moe.default, moe.args())
    att = attention_case(MIXED_BATCH[:4], 8, 2, 64, 16, torch.bfloat16, "cuda")
    torch.library.opcheck(torch.ops.rimuru.paged_attention.default, att.args())
    kv_view = torch.randn(4, 2, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    key, value = torch.randn(2, 3, 2, 64, device="cuda", dtype=torch.bfloat16).unbind(0)
    slots = torch.tensor([1, 40, -1], device="cuda")
    torch.library.opcheck(torch.ops.rimuru.write_kv.default, (key, value, kv_view, slots))


def test_compile_fullgraph_inductor_cuda():
    moe = moe_case(4, 8, 2, 64, 96, torch.bfloat16, "cuda")

    def layer(hidden, experts, table, ids, weights):
        return ops.paged_moe(torch.relu(hidden), experts, table, ids, weights, 64) * 2

    expected = layer(*moe.args()[:5])
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(*moe.args()[:5]), expected)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 128, 8, 16), (4096, 128, 8, 128),
                                                                    (777, 60, 4, 32), (3000, 60, 4, 64),
                                                                    (8, 128, 8, 16), (64, 60, 4, 16)])
@pytest.mark.parametrize("path", [{}, {"one_program": True}, {"one_program": False, "scan": False},
                                  {"one_program": False, "scan": True}, {"atomic": True}])  # {}: the op's path
def test_align_tokens_triton_matches_torch(num_tokens, num_experts, top_k, block_m, path):
    """Every path gives the torch layout; the atomic sort up to the order inside each run."""
    from rimuru.ops import moe_align

    if path.get("one_program") and num_tokens * top_k > moe_align.ONE_PROGRAM_MAX_PAIRS:
        pytest.skip("more pairs than one program sorts")
    topk_ids = torch.rand(num_tokens, num_experts, device="cuda").topk(top_k, dim=-1).indices
    sorted_ids, block_expert, num_padded = moe_align.align_tokens_torch(topk_ids, num_experts, block_m)
    tri = moe_align.align_tokens_triton(topk_ids, num_experts, block_m, **path)
    assert torch.equal(tri[1], block_expert) and torch.equal(tri[2], num_padded)
    in_pair_order = runs_in_pair_order(tri[0], block_expert, block_m) if path.get("atomic") else tri[0]
    assert torch.equal(in_pair_order, sorted_ids)


@pytest.mark.parametrize("num_tokens", [1024, 4096])
def test_the_op_with_the_atomic_sort_gives_the_same_values_bf16(num_tokens):
    """The atomic sort's runs in another order change no output: the op with `ATOMIC_SORT` equal, exactly, to the
    op over the count-and-scatter sort (Qwen3-30B-A3B's expert shape), eagerly and replayed from a graph."""
    from rimuru.ops.configs import moe_config
    from rimuru.ops.paged_moe import paged_moe_triton

    seed = int(torch.randint(0, 1 << 30, ()))
    case = moe_case(num_tokens, 128, 8, 768, 2048, torch.bfloat16, "cuda", seed)
    cfg = moe_config(num_tokens, 128, 768, 2048, 8, "cuda")
    expected = paged_moe_triton(*case.args(), config={**cfg, "ATOMIC_SORT": False})
    assert_equal_eager_and_replayed(lambda: paged_moe_triton(*case.args(), config={**cfg, "ATOMIC_SORT": True}),
                                    expected)  # fmt: skip


OP_PATHS = [(1, {}), (4, {"PAIR_BLOCKS": False}), (64, {"PAIR_BLOCKS": False}), (1024, {"ATOMIC_SORT": False}),
            (1024, {"ATOMIC_SORT": True}), (4096, {"ATOMIC_SORT": False})]  # pair blocks, each sort path


@pytest.mark.parametrize("key", ["PDL", "L2_HINTS"])
@pytest.mark.parametrize("num_tokens,extra", OP_PATHS)
def test_the_op_with_dependent_launches_or_l2_hints_gives_the_same_values_bf16(num_tokens, extra, key):
    """`PDL` (every launch of the op dependent on the one before it, each kernel waiting for the grid before it
    first) and `L2_HINTS` (the GEMMs' eviction hints): exactly the plain op's values eagerly and replayed from a
    graph, over one block a pair and every sort (one program, count and scatter, with the scan, atomic), Qwen3-30B-
    A3B's expert shape. On sm_90 the launches really are dependent (the Triton there has the launch option)."""
    from rimuru.ops.configs import moe_config
    from rimuru.ops.dependent_launch import pdl_supported
    from rimuru.ops.paged_moe import paged_moe_triton

    assert pdl_supported("cuda") == (torch.cuda.get_device_capability()[0] >= 9)
    seed = int(torch.randint(0, 1 << 30, ()))
    case = moe_case(num_tokens, 128, 8, 768, 2048, torch.bfloat16, "cuda", seed)
    cfg = {**moe_config(num_tokens, 128, 768, 2048, 8, "cuda"), **extra}
    expected = paged_moe_triton(*case.args(), config={**cfg, key: False})
    assert_equal_eager_and_replayed(lambda: paged_moe_triton(*case.args(), config={**cfg, key: True}), expected)


@pytest.mark.parametrize("num_tokens,top_k,hidden_size", [(1, 8, 2048), (4096, 8, 2048), (777, 4, 2048), (9, 6, 136)])
def test_topk_sum_bf16_fixed_order(num_tokens, top_k, hidden_size):
    """fp32 accumulation in k order: within a bf16 rounding of the fp32 sum, and the same bits on every run."""
    from rimuru.ops.topk_sum import topk_sum_triton as topk_sum

    pairs = torch.randn(num_tokens, top_k, hidden_size, device="cuda").to(torch.bfloat16)
    ref = pairs.float().sum(1)
    poison_allocator()
    tri = topk_sum(pairs)
    assert tri.dtype == torch.bfloat16 and rel_err(tri, ref) < 1e-2
    assert torch.equal(tri, topk_sum(pairs.clone()))


@pytest.mark.parametrize("flags", [{}, {"HEADS_FASTEST": True, "EVEN_TILES": True, "PREFETCH_PAGES": True},
                                   {"HEADS_FASTEST": True, "EVEN_TILES": True, "PREFETCH_PAGES": True,
                                    "PERSISTENT": True}])
@pytest.mark.parametrize("tile", [(128, 8, 2), (64, 4, 4), (32, 4, 6)])
def test_decode_attention_variants_bf16(flags, tile):
    from rimuru.ops.decode_attention import decode_attention_triton, decode_config

    seed = int(torch.randint(0, 1 << 30, ()))
    requests = [(n, 1) for n in (0, 15, 16, 200, 1023, 77, 4000, 127)]
    case = attention_case(requests, 32, 4, 128, 16, torch.bfloat16, "cuda", seed)
    ref = reference.paged_attention(*as_fp32(case.args()))
    cfg = decode_config(BLOCK_N=tile[0], num_warps=tile[1], num_stages=tile[2], **flags)
    poison_allocator()
    tri, _ = decode_attention_triton(case.query, case.kv_view, case.page_table, case.seq_lens, case.scale, cfg)
    assert rel_err(tri, ref) < 1e-2


@pytest.mark.parametrize("num_requests, in_pool_dtype", [(1, False), (64, True)])
def test_linear_attention_decode_kernels_update_the_pages_in_place(num_requests, in_pool_dtype):
    """Qwen3.5-35B's linear-attention geometry (16 key heads, 32 value heads of 128, conv of 8,192 channels), bf16
    inputs and fp32 states at scattered pages (handed over as fp32, or as the engine does, in the bf16 pool's dtype),
    and one padding row after the requests: the Triton decode kernels against the references."""
    gen = torch.Generator("cuda").manual_seed(num_requests)
    rows = num_requests + 1
    q, k = (torch.randn(2, rows, 16, 128, device="cuda", generator=gen)).bfloat16().unbind(0)
    v = torch.randn(rows, 32, 128, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(rows, 32, device="cuda", generator=gen)
    beta = torch.rand(rows, 32, device="cuda", generator=gen).bfloat16()
    pages = torch.randn(2 * rows + 1, 32, 128, 128, device="cuda", generator=gen)
    ids = torch.randperm(2 * rows + 1, device="cuda", generator=gen)[:rows]
    ids[-1] = -1
    ref_pages = pages.clone()
    ref = reference.gated_delta_step(q, k, v, g, beta, ref_pages, ids)
    tri = ops.gated_delta_step(q, k, v, g, beta, pages.view(torch.bfloat16) if in_pool_dtype else pages, ids)
    assert rel_err(tri, ref) < 1e-2 and rel_err(pages, ref_pages) < 1e-5
    x = torch.randn(rows, 8192, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(8192, 4, device="cuda", generator=gen).bfloat16()
    conv = torch.randn(2 * rows + 1, 8192, 3, device="cuda", generator=gen).bfloat16()
    ref_conv = conv.clone()
    ref = reference.causal_conv1d_step(x, ref_conv, ids, weight, None)
    tri = ops.causal_conv1d_step(x, conv, ids, weight, None)
    assert rel_err(tri, ref) < 1e-2 and torch.equal(conv, ref_conv)


@pytest.mark.parametrize("lengths", [[1, 40, 7], [300, 64]])
def test_linear_attention_prefill_on_gpu_equals_the_chunks(lengths):
    """A packed batch of prompt chunks at Qwen3.5-35B's geometry: flash-linear-attention's delta rule (where it is
    installed; else the reference on both sides) and the gathered conv against the references, fp32 states through
    scattered pages handed over in the bf16 pool's dtype, as the engine does."""
    gen = torch.Generator("cuda").manual_seed(len(lengths))
    tokens, n = sum(lengths), len(lengths)
    q, k = torch.randn(2, tokens, 16, 128, device="cuda", generator=gen).bfloat16().unbind(0)
    v = torch.randn(tokens, 32, 128, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(tokens, 32, device="cuda", generator=gen) * 0.5
    beta = torch.rand(tokens, 32, device="cuda", generator=gen).bfloat16()
    starts = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    ids = torch.randperm(2 * n, device="cuda", generator=gen)[:n]
    continues = torch.arange(n, device="cuda") % 2 == 0
    pages = torch.randn(2 * n, 32, 128, 128, device="cuda", generator=gen) * 0.1
    ref_pages = pages.clone()
    ref = reference.gated_delta_prefill(q, k, v, g, beta, ref_pages, ids, starts, continues)
    out = ops.gated_delta_prefill(q, k, v, g, beta, pages.view(torch.bfloat16), ids, starts, continues)
    assert rel_err(out, ref) < 2e-2 and rel_err(pages, ref_pages) < 2e-2
    x = torch.randn(tokens, 8192, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(8192, 4, device="cuda", generator=gen).bfloat16()
    conv = torch.randn(2 * n, 8192, 3, device="cuda", generator=gen).bfloat16()
    ref_conv = conv.clone()
    ref = reference.causal_conv1d_prefill(x, ref_conv, ids, starts, continues, weight, None)
    out = ops.causal_conv1d_prefill(x, conv, ids, starts, continues, weight, None)
    assert rel_err(out, ref) < 1e-2 and torch.equal(conv, ref_conv)
