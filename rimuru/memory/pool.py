"""The one block of device memory that expert weights, KV, SSM and conv states share
(docs/architecture.md, The page pool).

Owns the `uint8` tensor, allocated once, and the typed zero-copy views over it. Which page belongs to whom is the
`PageAllocator`'s business, not the pool's.
"""

import math

import torch

from rimuru.memory.sizes import PageSizes


class MemoryPool:
    """`num_bytes` of `device` memory seen through views: `view(dtype).view(num_pages, *page_shape)`.

    Every view starts at byte 0, so page id `i` of a view with stride `s` lies at byte `i * s`. Writing through
    one view is visible through every other at once: views copy nothing.
    """

    def __init__(self, sizes: PageSizes, num_bytes: int, device: torch.device | str = "cpu"):
        if num_bytes < sizes.huge_page_bytes:
            raise ValueError(f"a pool of {num_bytes} B cannot hold one huge page of {sizes.huge_page_bytes} B")
        self.sizes = sizes
        self.num_bytes = num_bytes - num_bytes % sizes.huge_page_bytes  # the rest is reported as padding
        self.data = torch.empty(self.num_bytes, dtype=torch.uint8, device=device)  # [bytes]
        # one typed tensor over the bytes per dtype, the `_base` of every view of that dtype: torch.compile takes
        # aliased views that a pass writes through only when they share their base
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return self.data.device

    def view(self, dtype: torch.dtype, page_stride: int, page_shape: tuple[int, ...]) -> torch.Tensor:
        """[num_pages, *page_shape] over the whole pool; padding between pages (stride > payload) is skipped."""
        typed = self._typed.setdefault(dtype, self.data.view(dtype))
        elem = typed.element_size()
        num_pages = self.num_bytes // page_stride
        inner = [math.prod(page_shape[i + 1 :]) for i in range(len(page_shape))]  # row-major within a page
        return typed.as_strided((num_pages, *page_shape), (page_stride // elem, *inner))

    def expert_view(self) -> torch.Tensor:
        """[P, F * D]: one expert matrix (gate, up or down) a page."""
        s = self.sizes
        return self.view(s.dtype, s.expert_page_bytes, s.expert_page_shape)

    def kv_view(self) -> torch.Tensor:
        """[P, 2, page_tokens, Hk, Dh]: K and V of one layer; every attention layer reads this same view."""
        s = self.sizes
        return self.view(s.dtype, s.kv_page_stride, s.kv_page_shape)

    def ssm_view(self) -> torch.Tensor:
        """[P, Hv, Dk, Dv]: one request's recurrent state of one linear-attention layer a page, in its own dtype."""
        s = self.sizes
        return self.view(s.ssm_dtype or s.dtype, s.ssm_page_stride, s.ssm_page_shape)

    def state_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(SSM pages, conv pages) as a hybrid model's linear-attention ops take them: the SSM pages in the pool's
        dtype (`ssm_view_in_pool_dtype`)."""
        return self.ssm_view_in_pool_dtype(), self.conv_view()

    def ssm_view_in_pool_dtype(self) -> torch.Tensor:
        """[P, Hv, Dk, Dv * r]: the SSM pages in the pool's dtype (r of its elements to a state element).
        torch.compile takes a view that a pass writes through only in its base's dtype (the other views'), so the
        ops take this one and read it in the state's dtype inside (`rimuru.ops.linear_attention.state_pages`)."""
        s = self.sizes
        state_size, pool_size = (s.ssm_dtype or s.dtype).itemsize, s.dtype.itemsize
        assert state_size % pool_size == 0, "a state element spans whole elements of the pool's dtype"
        *outer, value_dim = s.ssm_page_shape
        return self.view(s.dtype, s.ssm_page_stride, (*outer, value_dim * (state_size // pool_size)))

    def conv_view(self) -> torch.Tensor:
        """[P, C, W - 1]: one request's conv history of one linear-attention layer a page."""
        s = self.sizes
        return self.view(s.dtype, s.conv_page_stride, s.conv_page_shape)
