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


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):  # [T, N] each
    """The residual stream's add, then `rms_norm` of the sum: (normalised sum, sum)."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2F] -> [T, F]
    """SwiGLU's activation of a stacked gate/up projection: silu(gate) * up, gate the first half of each row."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def sigmoid_gated_add(base: torch.Tensor, gate_logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """base + sigmoid(gate_logits) * x (base, x [T, D], gate_logits [T, 1]): qwen2_moe's gated shared expert."""
    return base + torch.sigmoid(gate_logits) * x


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # q [T, Hq, Dh], k [T, Hk, Dh]
    """transformers' neox RoPE on q and k (cos, sin [T, Dh] in their dtype): x * cos + rotate_half(x) * sin, each
    product rounded to the dtype before the sum."""
    def rotate(x):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, H, Dh]
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    return rotate(q), rotate(k)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool, padding_rows: torch.Tensor | None = None):
    """The router's top-k experts [T, K] (int64, best first) and their softmax weights [T, K] (fp32), renormalised
    to sum to 1 when asked (qwen3_moe's norm_topk_prob). Rows flagged in `padding_rows` [T] route as row 0: a CUDA
    graph's padding touches no expert a real token does not."""  # logits [T, E] float32
    if padding_rows is not None:
        logits = torch.where(padding_rows[:, None], logits[:1], logits)
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


def rope_write_kv(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, kv_view: torch.Tensor, slot_mapping: torch.Tensor,
                  num_q_heads: int, num_kv_heads: int) -> torch.Tensor:  # fmt: skip
    """An attention layer's inputs from its fused projection's rows qkv [T, (Hq + 2 Hk) * Dh]: q and k normalised
    per head by q_weight, k_weight [Dh] (None: no q/k norm) and rotated by cos, sin [T, Dh], K and V written at their
    slots of kv_view [P, 2, S, Hk, Dh]; returns q [T, Hq, Dh], contiguous."""
    q, k, v = attention_heads(qkv, q_weight, k_weight, eps, cos, sin, num_q_heads, num_kv_heads, kv_view.shape[-1])
    write_kv(k, v, kv_view, slot_mapping)
    return q.contiguous()


def attention_heads(qkv, q_weight, k_weight, eps: float, cos, sin, num_q_heads: int, num_kv_heads: int,
                    head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(q [T, Hq, Dh], k, v [T, Hk, Dh]) of the fused projection's rows, q and k normalised and rotated."""
    q, k, v = qkv.unflatten(-1, (num_q_heads + 2 * num_kv_heads, head_dim)).split(
        (num_q_heads, num_kv_heads, num_kv_heads), 1)  # fmt: skip
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    q, k = rope(q, k, cos, sin)
    return q, k, v


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


# Linear-attention state views (hybrid models): one request's state of one linear layer a page.
#   ssm_view   [P, Hv, Dk, Dv]  the gated delta rule's recurrent state (the checkpoint's mamba_ssm_dtype)
#   conv_view  [P, C, W - 1]    the last W - 1 inputs of the causal depthwise conv (C channels, kernel width W)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _delta_inputs(q, k, v, g, beta, num_value_heads: int):
    """fp32 q, k (L2-normalised, q scaled by Dk^-0.5, repeated over the value heads they serve), v, g, beta."""
    group = num_value_heads // k.shape[-2]
    q, k = (_l2norm(x.float()).repeat_interleave(group, dim=-2) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def gated_delta_step(
    q: torch.Tensor,  # [B, Hk, Dk]
    k: torch.Tensor,  # [B, Hk, Dk]
    v: torch.Tensor,  # [B, Hv, Dv]
    g: torch.Tensor,  # [B, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [B, Hv] write strength
    ssm_view: torch.Tensor,  # [P, Hv, Dk, Dv]
    state_ids: torch.Tensor,  # [B] int: each request's state page; negative skips the row (padding)
) -> torch.Tensor:  # [B, Hv, Dv]
    """One token of the gated delta rule a request: S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q. The
    states are updated in place in their pages."""
    dtype = v.dtype
    q, k, v, g, beta = _delta_inputs(q, k, v, g, beta, v.shape[-2])
    out = torch.zeros_like(v)
    live = (state_ids >= 0).nonzero().flatten()
    ids = state_ids[live].long()
    state = ssm_view[ids].float() * g[live].exp()[..., None, None]  # [b, Hv, Dk, Dv]
    delta = (v[live] - (state * k[live].unsqueeze(-1)).sum(-2)) * beta[live].unsqueeze(-1)
    state = state + k[live].unsqueeze(-1) * delta.unsqueeze(-2)
    out[live] = (state * q[live].unsqueeze(-1)).sum(-2)
    ssm_view[ids] = state.to(ssm_view.dtype)
    return out.to(dtype)


# tokens the chunked delta rule takes at a time in matrix form (Hugging Face's and flash-linear-attention's block):
# a prompt cut only at multiples of it from its first token rounds the same however it is cut
DELTA_RULE_BLOCK = 64


def gated_delta_chunk(
    q: torch.Tensor,  # [T, Hk, Dk] one request's consecutive tokens
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    ssm_view: torch.Tensor,  # [P, Hv, Dk, Dv]
    state_id: int,  # the request's state page: read when `continues`, written with the state after the last token
    continues: bool,  # False: the chunk starts the sequence (a zero state)
    chunk_size: int = DELTA_RULE_BLOCK,
) -> torch.Tensor:  # [T, Hv, Dv]
    """The gated delta rule over a prompt chunk, `chunk_size` tokens at a time in matrix form (the WY / UT
    transform): equal to `gated_delta_step` token by token, carried exactly across calls through the state page."""
    dtype = v.dtype
    q, k, v, g, beta = (x.transpose(0, 1) for x in _delta_inputs(q, k, v, g, beta, v.shape[-2]))  # [Hv, T, ...]
    num_tokens = q.shape[1]
    state = ssm_view[state_id].float() if continues else torch.zeros_like(ssm_view[state_id], dtype=torch.float32)
    out = torch.empty_like(v)
    mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        n = end - start
        decay = g[:, start:end].cumsum(-1)  # [Hv, n] log decay from the chunk's start through each token
        pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~mask[:n, :n], float("-inf")).exp()
        kbeta = kc * bc.unsqueeze(-1)
        # (I + strictly-lower(beta k k^T decay)) solves for each token's correction u and decayed-key read w
        system = (kbeta @ kc.transpose(-1, -2)) * pair
        system = system.tril(-1) + torch.eye(n, dtype=system.dtype, device=system.device)
        u = torch.linalg.solve_triangular(system, vc * bc.unsqueeze(-1), upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kbeta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
        u = u - w @ state  # the part of the new values the carried state does not already predict
        out[:, start:end] = (qc * decay.exp().unsqueeze(-1)) @ state + ((qc @ kc.transpose(-1, -2)) * pair) @ u
        tail = (decay[:, -1:] - decay).exp().unsqueeze(-1)  # decay from each token to the chunk's end
        state = state * decay[:, -1].exp()[:, None, None] + (kc * tail).transpose(-1, -2) @ u
    ssm_view[state_id] = state.to(ssm_view.dtype)
    return out.transpose(0, 1).to(dtype).contiguous()


def causal_conv1d_step(
    x: torch.Tensor,  # [B, C] one token a request
    conv_view: torch.Tensor,  # [P, C, W - 1]
    state_ids: torch.Tensor,  # [B] int; negative skips the row
    weight: torch.Tensor,  # [C, W]
    bias: torch.Tensor | None,  # [C]
) -> torch.Tensor:  # [B, C]
    """SiLU(depthwise causal conv) of each request's next input over its last W - 1 inputs, which shift in place."""
    out = torch.zeros_like(x)
    live = (state_ids >= 0).nonzero().flatten()
    ids = state_ids[live].long()
    window = torch.cat([conv_view[ids].to(x.dtype), x[live].unsqueeze(-1)], dim=-1)  # [b, C, W]
    y = (window.float() * weight.float()).sum(-1) + (0 if bias is None else bias.float())
    out[live] = torch.nn.functional.silu(y).to(x.dtype)
    conv_view[ids] = window[..., 1:].to(conv_view.dtype)
    return out


def causal_conv1d_chunk(
    x: torch.Tensor,  # [T, C] one request's consecutive inputs
    conv_view: torch.Tensor,  # [P, C, W - 1]
    state_id: int,
    continues: bool,  # False: the chunk starts the sequence (zero history)
    weight: torch.Tensor,  # [C, W]
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [T, C]
    """`causal_conv1d_step` over a chunk of one request; its state page ends holding the last W - 1 inputs."""
    history = conv_view[state_id].to(x.dtype) if continues else x.new_zeros(conv_view.shape[1:])
    window = torch.cat([history, x.transpose(0, 1)], dim=-1)  # [C, W - 1 + T]
    y = torch.nn.functional.conv1d(window.float().unsqueeze(0), weight.float().unsqueeze(1), None if bias is None
                                   else bias.float(), groups=weight.shape[0])[0]  # fmt: skip
    conv_view[state_id] = window[:, -conv_view.shape[-1]:].to(conv_view.dtype)
    return torch.nn.functional.silu(y).transpose(0, 1).to(x.dtype).contiguous()


def gated_delta_prefill(q, k, v, g, beta, ssm_view: torch.Tensor, state_ids: torch.Tensor,
                        query_start_loc: torch.Tensor, continues: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`gated_delta_chunk` over each request's tokens of a packed batch (q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta
    [T, Hv]; request r's tokens from query_start_loc[r]), its state from and back into page state_ids[r] (< 0:
    no state, zero output), starting from zero where continues[r] is False."""
    out = torch.zeros_like(v)
    starts, ids, carried = query_start_loc.tolist(), state_ids.tolist(), continues.tolist()
    for r, state_id in enumerate(ids):
        s, e = starts[r], starts[r + 1]
        if state_id >= 0 and e > s:
            out[s:e] = gated_delta_chunk(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], ssm_view, state_id, carried[r])
    return out


def causal_conv1d_prefill(x: torch.Tensor, conv_view: torch.Tensor, state_ids: torch.Tensor,
                          query_start_loc: torch.Tensor, continues: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """`causal_conv1d_chunk` over each request's tokens of a packed batch (x [T, C]), as `gated_delta_prefill`."""
    out = torch.zeros_like(x)
    starts, ids, carried = query_start_loc.tolist(), state_ids.tolist(), continues.tolist()
    for r, state_id in enumerate(ids):
        s, e = starts[r], starts[r + 1]
        if state_id >= 0 and e > s:
            out[s:e] = causal_conv1d_chunk(x[s:e], conv_view, state_id, carried[r], weight, bias)
    return out
