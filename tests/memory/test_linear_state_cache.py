"""A hybrid model's state pages in the one pool: SSM pages (middle tier, their own dtype) and conv pages (small tier)
taken all at once at admission, kept apart from the request's KV, and given back whole."""

import pytest
import torch

from rimuru.linear_state_cache import LinearStateCache
from rimuru.memory import CONV, EXPERT, KV, SSM, MemoryPool, PageAllocator, page_sizes

LAYERS = 3


def hybrid_sizes():
    """bf16 pool: expert page 512 B (256 elements), KV page 64 B, fp32 SSM page 1024 B [2, 4, 32], conv page 48 B."""
    return page_sizes(expert_page_shape=(256,), kv_page_shape=(2, 2, 2, 4), dtype=torch.bfloat16,
                      ssm_page_shape=(2, 4, 32), conv_page_shape=(8, 3), ssm_dtype=torch.float32)  # fmt: skip


def test_the_ssm_page_is_sized_in_its_own_dtype_and_its_view_aliases_the_pool():
    sizes = hybrid_sizes()
    assert sizes.ssm_page_bytes == 2 * 4 * 32 * 4 and sizes.huge_page_bytes == 1024
    pool = MemoryPool(sizes, 4 * 1024, device="cpu")
    ssm, experts = pool.ssm_view(), pool.expert_view()
    assert ssm.dtype == torch.float32 and ssm.shape == (4, 2, 4, 32) and experts.shape == (8, 256)
    pool.data.zero_()
    ssm[1].fill_(1.0)  # SSM page 1 is huge page 1: expert pages 2 and 3
    assert (experts[2:4].view(torch.float32) == 1.0).all()
    assert (experts[:2] == 0).all() and (experts[4:] == 0).all()


def test_the_ssm_pages_in_the_pools_dtype_are_the_same_bytes_the_ops_read_as_fp32():
    from rimuru.ops.linear_attention import state_pages

    pool = MemoryPool(hybrid_sizes(), 4 * 1024, device="cpu")
    raw = pool.ssm_view_in_pool_dtype()
    assert raw.dtype == torch.bfloat16 and raw.shape == (4, 2, 4, 64) and raw._base is pool.kv_view()._base
    ssm = pool.ssm_view()
    ssm.copy_(torch.randn(4, 2, 4, 32))
    assert torch.equal(state_pages(raw), ssm) and state_pages(ssm) is ssm  # a view in the state's dtype as it is
    state_pages(raw)[2].zero_()  # writes through the op's reading land in the pool
    assert (pool.ssm_view()[2] == 0).all() and (pool.ssm_view()[3] != 0).all()


def test_a_request_takes_every_layers_state_at_once_and_gives_it_back_whole():
    sizes = hybrid_sizes()
    allocator = PageAllocator(sizes, pool_bytes=8 * 1024)
    cache = LinearStateCache(allocator, LAYERS)
    assert cache.allocate("a") and cache.allocate("b")
    ssm, conv = cache.state_tables(["a", "b"])
    assert ssm.shape == conv.shape == (LAYERS, 2)
    assert len(set(ssm.flatten().tolist())) == 2 * LAYERS and len(set(conv.flatten().tolist())) == 2 * LAYERS
    assert allocator.num_used_pages(SSM) == 2 * LAYERS and allocator.num_used_pages(CONV) == 2 * LAYERS
    assert allocator.allocate("a", 2, KV) is not None  # the request's KV belongs to it, its state to (id, "state")
    cache.free("a")
    assert allocator.num_used_pages(KV) == 2 and allocator.num_used_pages(SSM) == LAYERS
    allocator.free("a")
    cache.free("b")
    allocator.check_integrity()
    assert allocator.stats()["used_bytes"] == 0 and allocator.num_free_expert_pages == 16


def test_admission_is_all_or_nothing_when_the_pool_runs_short():
    sizes = hybrid_sizes()
    allocator = PageAllocator(sizes, pool_bytes=4 * 1024)
    cache = LinearStateCache(allocator, LAYERS)
    assert cache.allocate("a")  # 3 SSM pages (3 huge pages) and 3 conv pages (one expert page of the last huge)
    before = allocator.stats()
    assert not cache.allocate("b")  # one huge page left: not enough SSM pages for three layers
    assert allocator.stats() == before and not cache.holds("b")
    allocator.check_integrity()
    cache.free("a")
    assert allocator.allocate("experts", 8, EXPERT) is not None  # every page merged back


def test_the_shortfall_of_one_request_in_expert_pages():
    allocator = PageAllocator(hybrid_sizes(), pool_bytes=4 * 1024)
    # 3 fp32 SSM pages of 1024 B = 6 expert pages; 3 conv pages of 48 B fit one 512 B expert page
    assert LinearStateCache(allocator, LAYERS).expert_pages_per_request() == 7


def test_a_request_cannot_take_its_state_twice():
    cache = LinearStateCache(PageAllocator(hybrid_sizes(), pool_bytes=4 * 1024), LAYERS)
    assert cache.allocate("a")
    with pytest.raises(ValueError, match="already holds"):
        cache.allocate("a")


def test_a_hybrid_models_page_sizes_hold_its_state_exactly():
    """Qwen3-Next-80B's full-size config: its fp32 recurrent state [32, 128, 128] is 2 MiB, exactly an expert page
    (512 x 2048 in bf16), and its conv history [2 * 16 * 128 + 32 * 128, 3] in bf16 is 48 KiB."""
    from rimuru.memory import page_sizes_for_model
    from rimuru.models import ModelConfig

    raw = {
        "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "moe_intermediate_size": 512,
        "num_experts_per_tok": 10, "num_experts": 512, "full_attention_interval": 4, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "shared_expert_intermediate_size": 512}  # fmt: skip
    sizes = page_sizes_for_model(ModelConfig.from_hf(raw), torch.bfloat16)
    assert sizes.expert_page_bytes == 512 * 2048 * 2 == 2 * 2**20
    assert sizes.ssm_page_bytes == 32 * 128 * 128 * 4 == sizes.ssm_page_stride == 2 * 2**20
    assert sizes.conv_page_bytes == (2 * 16 * 128 + 32 * 128) * 3 * 2 == 48 * 2**10
    assert sizes.ssm_dtype == torch.float32
