"""The allocator on hand-checked cases: exact page ids, the real model sizes, aliasing views, bad input."""

import types

import pytest
import torch

from rimuru.memory import EXPERT, KV, MemoryPool, PageAllocator, page_sizes, page_sizes_for_model

# The fields that size pages, from the released config.json files of the two models.
REAL_CONFIGS = {
    "qwen1.5-moe-a2.7b": dict(hidden_size=2048, moe_intermediate_size=1408, num_attention_heads=16, num_key_value_heads=16),
    "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128),
}


def tiny_sizes():
    """Expert page 256 B (64 fp32), KV page 64 B (2 x 2 tokens x 1 head x 4): four KV pages an expert page."""
    return page_sizes(expert_page_shape=(64,), kv_page_shape=(2, 2, 1, 4), dtype=torch.float32)


def test_worked_example_three_requests_share_one_expert_page():
    a = PageAllocator(tiny_sizes(), pool_bytes=4 * 256)
    assert a.allocate("r1", 2) == [0, 1]
    assert a.allocate("r2", 1) == [2]  # a free small page already split off comes first
    assert a.allocate("r3", 1) == [3]
    assert a.stats()["kv_used_pages"] == 4 and a.num_free_expert_pages == 3
    a.free("r1")
    a.free("r2")
    a.check_integrity()
    stats = a.stats()
    assert stats["trapped_bytes"] == 3 * 64 and stats["kv_trapped_pages"] == 3
    assert a.num_free_expert_pages == 3  # expert page 0 still cannot hold an expert matrix
    assert a.allocate("big", 4, EXPERT) is None
    a.free("r3")
    a.check_integrity()
    assert a.stats()["trapped_bytes"] == 0 and a.num_free_expert_pages == 4
    assert a.allocate(("layer0", 5), 1, EXPERT) == [0]  # merged back: holds one expert matrix again


def test_request_keeps_carving_from_its_own_expert_page():
    a = PageAllocator(tiny_sizes(), pool_bytes=4 * 256)
    assert a.allocate("r1", 1) == [0]
    assert a.allocate("r2", 3) == [1, 2, 3]
    assert a.allocate("r2", 1) == [4]  # page 0 full: r2 splits expert page 1
    assert a.allocate("r1", 1) == [5]  # rule 1: a free small page already split off
    a.free("r2")
    assert a.pages_of("r1", KV) == [0, 5] and a.stats()["kv_trapped_pages"] == 6


def test_expert_pages_go_three_at_a_time_and_none_when_full():
    a = PageAllocator(tiny_sizes(), pool_bytes=7 * 256)
    assert a.allocate_expert(("l0", 0)) == [0, 1, 2]
    assert a.allocate_expert(("l0", 1)) == [3, 4, 5]
    assert a.allocate_expert(("l0", 2)) is None
    assert a.allocate("r", 5) is None  # only one expert page (4 KV pages) left
    assert a.allocate("r", 4) == [24, 25, 26, 27]
    a.free(("l0", 0))
    assert a.num_free_expert_pages == 3 and a.expert_pages_for(9) == 3
    a.check_integrity()


@pytest.mark.parametrize(
    "model, kv_per_expert", [("qwen1.5-moe-a2.7b", 44), ("qwen3-30b-a3b", 96)]
)
def test_real_model_sizes(model, kv_per_expert):
    config = types.SimpleNamespace(**REAL_CONFIGS[model])
    sizes = page_sizes_for_model(config, torch.bfloat16)
    assert sizes.kv_pages_per_expert_page == kv_per_expert
    assert sizes.kv_padding_bytes == 0 and sizes.huge_page_bytes == sizes.expert_page_bytes
    assert sizes.expert_page_bytes == {44: 5_767_168, 96: 3_145_728}[kv_per_expert]


def test_views_alias_the_byte_pool():
    sizes = tiny_sizes()
    pool = MemoryPool(sizes, 4 * 256)
    a = PageAllocator(sizes, pool.num_bytes)
    kv = pool.kv_view()  # [16, 2, 2, 1, 4]
    (page,) = a.allocate("r", 1)
    a.allocate("q", 5)
    kv[page + 5].fill_(3.5)
    offset = (page + 5) * sizes.kv_page_stride
    assert torch.all(pool.data[offset : offset + sizes.kv_page_bytes].view(torch.float32) == 3.5)


def test_reclaimed_expert_page_is_readable_as_kv_without_copy():
    sizes = tiny_sizes()
    pool = MemoryPool(sizes, 2 * 256)
    a = PageAllocator(sizes, pool.num_bytes)
    experts, kv = pool.expert_view(), pool.kv_view()
    (expert_page,) = a.allocate("e", 1, EXPERT)
    experts[expert_page] = torch.arange(64, dtype=torch.float32)
    a.free("e")
    kv_pages = a.allocate("r", 4)
    assert kv_pages == [0, 1, 2, 3] and kv.untyped_storage().data_ptr() == experts.untyped_storage().data_ptr()
    assert torch.equal(kv[kv_pages].flatten(), torch.arange(64, dtype=torch.float32))


def test_padding_is_reported_when_kv_page_does_not_divide_expert_page():
    # expert page 5120 B, KV page 4096 B: the KV stride pads to 5120 (one a page, 1024 B padding).
    sizes = page_sizes((40 * 32,), (2, 16, 2, 16), torch.float32)
    assert sizes.kv_page_stride == 5120 and sizes.kv_padding_bytes == 1024 and sizes.notes
    pool = MemoryPool(sizes, 3 * 5120 + 100)
    a = PageAllocator(sizes, 3 * 5120 + 100)
    a.allocate("r", 2)
    assert a.stats()["padding_bytes"] == 100 + 2 * 1024
    assert pool.kv_view().shape == (3, 2, 16, 2, 16)
    a.check_integrity()


def test_sizes_that_cannot_nest_name_the_sizes():
    with pytest.raises(ValueError, match="4096 bytes.*1024 bytes"):
        page_sizes((256,), (2, 16, 2, 16), torch.float32)
    with pytest.raises(ValueError, match="huge page"):
        MemoryPool(tiny_sizes(), 100)


def test_double_free_and_foreign_pages_raise_and_change_nothing():
    a = PageAllocator(tiny_sizes(), pool_bytes=4 * 256)
    a.allocate("r1", 3)
    a.allocate("r2", 2)
    before = a.stats()
    with pytest.raises(ValueError):
        a.free_pages("r1", [3])  # r2's page
    with pytest.raises(ValueError):
        a.free_pages("r1", [0, 0])
    a.free_pages("r1", [1])
    with pytest.raises(ValueError):
        a.free_pages("r1", [1])  # twice
    with pytest.raises(KeyError):
        a.free("nobody")
    a.check_integrity()
    assert a.stats()["kv_used_pages"] == before["kv_used_pages"] - 1
    a.free("r1")
    with pytest.raises(KeyError):
        a.free("r1")
    a.check_integrity()
