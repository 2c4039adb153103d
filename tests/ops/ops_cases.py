"""Random inputs for the op tests: pools poisoned between pages, pages placed at random, padded page strides.

Poison (NaN) fills every byte no page table points at, the row padding and the unused tail of each request's last
KV page, so a kernel that reads past a mask returns NaN instead of a plausible number.
"""

from dataclasses import dataclass

import torch

POISON = float("nan")


@dataclass
class MoeCase:
    hidden: torch.Tensor  # [T, D]
    expert_view: torch.Tensor  # [P, F * D], a view of a padded pool
    page_table: torch.Tensor  # [E, 3] int32
    topk_ids: torch.Tensor  # [T, K]
    topk_weights: torch.Tensor  # [T, K] float32
    num_features: int

    def args(self):
        return self.hidden, self.expert_view, self.page_table, self.topk_ids, self.topk_weights, self.num_features


def moe_case(num_tokens, num_experts, top_k, num_features, hidden_size, dtype=torch.float32, device="cpu",
             seed=0, identity=False, num_loading=2):
    """Expert pages shuffled over a pool with free pages between them; `num_loading` experts sit in a loading buffer
    at the pool's end. `identity`: expert e's pages are 3e, 3e + 1, 3e + 2 in an unpadded pool."""
    gen = torch.Generator().manual_seed(seed)
    page_elems = num_features * hidden_size
    if identity:
        num_pages, row = 3 * num_experts, page_elems
        page_table = torch.arange(3 * num_experts, dtype=torch.int32).view(num_experts, 3)
    else:
        num_resident = num_experts - num_loading
        num_main = 3 * num_resident + num_experts + 1  # free pages scattered among the resident ones
        num_pages, row = num_main + 3 * num_loading, page_elems + 24
        main = torch.randperm(num_main, generator=gen)[: 3 * num_resident]
        loading = num_main + torch.randperm(3 * num_loading, generator=gen)
        expert_order = torch.randperm(num_experts, generator=gen)  # which experts sit in the loading buffer
        page_table = torch.empty(num_experts, 3, dtype=torch.int32)
        page_table[expert_order] = torch.cat([main, loading]).view(num_experts, 3).to(torch.int32)
    pool = torch.full((num_pages, row), POISON, dtype=torch.float32)
    weights = torch.randn(3 * num_experts, page_elems, generator=gen) / hidden_size**0.5
    weights[2::3] *= (hidden_size / num_features) ** 0.5  # down pages read F features
    pool[page_table.flatten().long(), :page_elems] = weights
    expert_view = pool.to(dtype).to(device)[:, :page_elems]
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype).to(device)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    topk_weights, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
    return MoeCase(hidden, expert_view, page_table.to(device), topk_ids.to(device), topk_weights.to(device),
                   num_features)


@dataclass
class AttentionCase:
    query: torch.Tensor  # [T, Hq, Dh]
    kv_view: torch.Tensor  # [P, 2, S, Hk, Dh], a view of a padded pool
    page_table: torch.Tensor  # [B, max pages] int32, -1 past each request's pages
    seq_lens: torch.Tensor  # [B]
    query_start_loc: torch.Tensor  # [B + 1]
    scale: float

    def args(self):
        return self.query, self.kv_view, self.page_table, self.seq_lens, self.query_start_loc, self.scale


def attention_case(requests, num_heads, num_kv_heads, head_dim, page_tokens, dtype=torch.float32, device="cpu",
                   seed=0, spare_pages=5):
    """`requests`: (cached tokens before this step, new tokens) per request. Pages are shuffled over the pool."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + new for ctx, new in requests]
    pages_of = [-(-n // page_tokens) for n in seq_lens]
    num_pages = sum(pages_of) + spare_pages
    page_elems = 2 * page_tokens * num_kv_heads * head_dim
    pool = torch.full((num_pages, page_elems + 40), POISON, dtype=torch.float32)
    kv = pool[:, :page_elems].view(num_pages, 2, page_tokens, num_kv_heads, head_dim)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    page_table = torch.full((len(requests), max(pages_of) + 2), -1, dtype=torch.int32)
    for b, (n, num) in enumerate(zip(seq_lens, pages_of)):
        ids = [perm.pop() for _ in range(num)]
        page_table[b, :num] = torch.tensor(ids, dtype=torch.int32)
        for i in range(n):  # only written slots hold data; the rest of the last page stays poisoned
            kv[ids[i // page_tokens], :, i % page_tokens] = torch.randn(2, num_kv_heads, head_dim, generator=gen)
    new_tokens = [new for _, new in requests]
    query_start_loc = torch.tensor([0] + new_tokens).cumsum(0).to(torch.int32)
    query = torch.randn(sum(new_tokens), num_heads, head_dim, generator=gen)
    pool = pool.to(dtype).to(device)
    kv_view = pool[:, :page_elems].view(num_pages, 2, page_tokens, num_kv_heads, head_dim)
    return AttentionCase(query.to(dtype).to(device), kv_view, page_table.to(device),
                         torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc.to(device),
                         head_dim**-0.5)


MIXED_BATCH = [(37, 1), (20, 19), (0, 23), (5, 1), (9, 0), (0, 1), (64, 7)]  # decode, chunk, prefill, empty


def runs_in_pair_order(sorted_ids, block_expert, block_m):
    """`sorted_ids` with each expert's run sorted: a sort's layout up to the order inside runs (the atomic sort's
    runs hold their pairs in any order)."""
    rows = sorted_ids.clone()
    experts_of_rows = block_expert.repeat_interleave(block_m)[: rows.numel()]
    for expert in experts_of_rows.unique().tolist():
        run = experts_of_rows == expert
        rows[run] = rows[run].sort().values
    return rows
