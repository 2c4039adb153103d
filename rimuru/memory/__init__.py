"""The unified page pool: one block of device memory, its typed views, and the three-tier page allocator."""

from rimuru.memory.allocator import CONV, EXPERT, KV, PAGES_PER_EXPERT, SSM, PageAllocator
from rimuru.memory.pool import MemoryPool
from rimuru.memory.sizes import DEFAULT_PAGE_TOKENS, PageSizes, fitting_page_tokens, page_sizes, page_sizes_for_model

__all__ = [
    "CONV", "DEFAULT_PAGE_TOKENS", "EXPERT", "KV", "PAGES_PER_EXPERT", "SSM",
    "MemoryPool", "PageAllocator", "PageSizes", "fitting_page_tokens", "page_sizes", "page_sizes_for_model",
]  # fmt: skip
