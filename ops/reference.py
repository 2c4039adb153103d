"""Plain torch references of Rimuru's ops: the definition of what each kernel computes, and the CPU kernels.

Shape letters (project-wide): T tokens, B requests, D hidden size, F expert intermediate size, E experts,
K top-k, P pages, Hq query heads, Hk KV heads, Dh head dim, S page tokens.

Pool views these ops read (docs/architecture.md, The page pool and Expert tiers):
  expert_view  [P, F * D]          one expert matrix a page: gate [F, D], up [F, D] or down [D, F], row-major
  kv_view      [P, 2, S, Hk, Dh]   K (index 0) and V (index 1) of S consecutive tokens of one attention layer
Page tables hold page ids into those views; -1 marks "no page".
"""

import torch


def expert_matrices(expert_view: torch.Tensor, pages: torch.Tensor, num_features: int, hidden_size: int):
    """Gate [F, D], up [F, D] and down [D, F] of one expert from its three page ids (gate, up, down)."""
    gate = expert_view[pages[0]].view(num_features, hidden_size)
    up = expert_view[pages[1]].view(num_features, hidden_size)
    down = expert_view[pages[2]].view(hidden_size, num_features)
    return gate, up, down


def paged_moe(
    hidden: torch.Tensor,  # [T, D]
    expert_view: torch.Tensor,  # [P, F * D]
    page_table: torch.Tensor,  # [E, 3] int32: gate, up, down page ids
    topk_ids: torch.Tensor,  # [T, K] int
    topk_weights: torch.Tensor,  # [T, K] float32
    num_features: int,  # F
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # gate, up [E, F, D], down [E, D, F]
) -> torch.Tensor:  # [T, D]
    """Sum over k of topk_weights[t, k] * down(silu(gate x) * up x) for expert topk_ids[t, k]; fp32 accumulation.
    An expert whose pages are -1 (not in the pool) is read from `host` when given, else adds nothing."""
    num_tokens, hidden_size = hidden.shape
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)  # [T, D]
    for expert_id in torch.unique(topk_ids).tolist():
        if page_table[expert_id, 2] < 0 and host is None:
            continue
        token_idx, k_idx = torch.nonzero(topk_ids == expert_id, as_tuple=True)  # [A], [A]
        if page_table[expert_id, 2] < 0:
            gate, up, down = (m[expert_id].to(hidden.device) for m in host)
        else:
            gate, up, down = expert_matrices(expert_view, page_table[expert_id].long(), num_features, hidden_size)
        x = hidden[token_idx].float()  # [A, D]
        act = torch.nn.functional.silu(x @ gate.float().T) * (x @ up.float().T)  # [A, F]
        y = act @ down.float().T  # [A, D]
        out.index_add_(0, token_idx, y * topk_weights[token_idx, k_idx].float()[:, None])
    return out.to(hidden.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # x [..., N], weight [N]
    """transformers' Qwen RMSNorm: normalised in fp32, rounded to x's dtype, then scaled by the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # q [T, Hq, Dh], k [T, Hk, Dh]
    """transformers' neox RoPE on q and k (cos, sin [T, Dh] in their dtype): x * cos + rotate_half(x) * sin, each
    product rounded to the dtype before the sum."""
    def rotate(x):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, H, Dh]
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    return rotate(q), rotate(k)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool):  # logits [T, E] float32
    """The router's top-k experts [T, K] (int64, best first) and their softmax weights [T, K] (fp32), renormalised
    to sum to 1 when asked (qwen3_moe's norm_topk_prob)."""
    weights, ids = torch.topk(logits.float().softmax(dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def write_kv(
    key: torch.Tensor,  # [T, Hk, Dh]
    value: torch.Tensor,  # [T, Hk, Dh]
    kv_view: torch.Tensor,  # [P, 2, S, Hk, Dh]
    slot_mapping: torch.Tensor,  # [T] int: page_id * S + offset in page; < 0 skips the token
) -> None:
    """Store each token's K and V at its slot, in place."""
    page_tokens = kv_view.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pages, offsets = slots // page_tokens, slots % page_tokens
    kv_view[pages, 0, offsets] = key[keep].to(kv_view.dtype)
    kv_view[pages, 1, offsets] = value[keep].to(kv_view.dtype)


def gather_kv(kv_view: torch.Tensor, page_ids: torch.Tensor, seq_len: int):
    """K and V [seq_len, Hk, Dh] of one request from its page ids, in token order."""
    pages = kv_view[page_ids.long()]  # [P, 2, S, Hk, Dh]
    keys = pages[:, 0].flatten(0, 1)[:seq_len]  # [L, Hk, Dh]
    values = pages[:, 1].flatten(0, 1)[:seq_len]  # [L, Hk, Dh]
    return keys, values


def paged_attention(
    query: torch.Tensor,  # [T, Hq, Dh], requests packed one after another
    kv_view: torch.Tensor,  # [P, 2, S, Hk, Dh]
    page_table: torch.Tensor,  # [B, max pages] int32, this layer's pages of each request
    seq_lens: torch.Tensor,  # [B] tokens in the cache for each request, this step's included
    query_start_loc: torch.Tensor,  # [B + 1] offsets of each request's queries in `query`
    scale: float,
) -> torch.Tensor:  # [T, Hq, Dh]
    """Causal attention of each request's new tokens (the last ones of its sequence) over its cached K/V; GQA."""
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], kv_view.shape[3]
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len, num_queries = int(seq_lens[b]), end - start
        if num_queries == 0:
            continue
        num_pages = -(-seq_len // kv_view.shape[2])
        keys, values = gather_kv(kv_view, page_table[b, :num_pages], seq_len)  # [L, Hk, Dh]
        keys = keys.float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, Hq, Dh]
        values = values.float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, Hq, Dh]
        q = query[start:end].float()  # [Q, Hq, Dh]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale  # [Hq, Q, L]
        q_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)  # [Q]
        k_pos = torch.arange(seq_len, device=query.device)  # [L]
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(query.dtype)
    return out
