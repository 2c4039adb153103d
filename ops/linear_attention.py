"""`rimuru::gated_delta_step`, `rimuru::gated_delta_prefill`, `rimuru::causal_conv1d_step` and
`rimuru::causal_conv1d_prefill`: a hybrid model's linear-attention layers over their state pages, each state updated
in place in its page.

The references in `rimuru.ops.reference` are the kernels on the CPU, and on a GPU where no kernel below serves.
On a GPU the decode steps run Triton kernels that read and write each request's state where it lies in its page
(through `state_ids`, no gather and scatter of whole states): one program a request, value head and block of
value dims for the delta rule, one a request and block of channels for the conv. A packed batch of prompt chunks
(`*_prefill`) runs on a GPU as flash-linear-attention's chunked delta rule over the batch (the states gathered from
their pages and written back once) when that package is installed, and as a few gathers for the conv.
"""

import functools

import torch
import triton
import triton.language as tl

from rimuru.ops import reference

STATE_DTYPE = torch.float32  # the recurrent state's dtype (`models.config.STATE_DTYPES`)


def state_pages(ssm_view: torch.Tensor) -> torch.Tensor:
    """The SSM pages [P, Hv, Dk, Dv] in the state's dtype, from a view in it or in the pool's dtype
    (`MemoryPool.ssm_view_in_pool_dtype`: what a compiled pass can hand over), reinterpreted here, inside the op."""
    return ssm_view if ssm_view.dtype == STATE_DTYPE else ssm_view.view(STATE_DTYPE)


@torch.library.custom_op("rimuru::gated_delta_step", mutates_args=("ssm_view",))
def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ssm_view: torch.Tensor, state_ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return reference.gated_delta_step(q, k, v, g, beta, state_pages(ssm_view), state_ids)


@gated_delta_step.register_fake
def _gated_delta_step_fake(q, k, v, g, beta, ssm_view, state_ids):
    return torch.empty_like(v)


@torch.library.custom_op("rimuru::causal_conv1d_step", mutates_args=("conv_view",))
def causal_conv1d_step(x: torch.Tensor, conv_view: torch.Tensor, state_ids: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    return reference.causal_conv1d_step(x, conv_view, state_ids, weight, bias)


@torch.library.custom_op("rimuru::gated_delta_prefill", mutates_args=("ssm_view",))
def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        ssm_view: torch.Tensor, state_ids: torch.Tensor, query_start_loc: torch.Tensor,
                        continues: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return reference.gated_delta_prefill(q, k, v, g, beta, state_pages(ssm_view), state_ids, query_start_loc, continues)


@gated_delta_prefill.register_fake
def _gated_delta_prefill_fake(q, k, v, g, beta, ssm_view, state_ids, query_start_loc, continues):
    return torch.empty_like(v)


@torch.library.custom_op("rimuru::causal_conv1d_prefill", mutates_args=("conv_view",))
def causal_conv1d_prefill(x: torch.Tensor, conv_view: torch.Tensor, state_ids: torch.Tensor,
                          query_start_loc: torch.Tensor, continues: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    return reference.causal_conv1d_prefill(x, conv_view, state_ids, query_start_loc, continues, weight, bias)


@causal_conv1d_prefill.register_fake
def _causal_conv1d_prefill_fake(x, conv_view, state_ids, query_start_loc, continues, weight, bias):
    return torch.empty_like(x)


@causal_conv1d_step.register_fake
def _causal_conv1d_step_fake(x, conv_view, state_ids, weight, bias):
    return torch.empty_like(x)


@triton.jit
def _l2_normalised(x):
    return x * tl.rsqrt(tl.sum(x * x, 0) + 1e-6)


@triton.jit
def _gated_delta_step_kernel(p_q, p_k, p_v, p_g, p_beta, p_ssm, p_ids, p_out, num_v_heads, group, stride_page, stride_qb,
                             stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_betab,
                             stride_ob, stride_oh, scale, HEAD_K: tl.constexpr, HEAD_V: tl.constexpr, BLOCK_V: tl.constexpr,
                             BLOCK_K: tl.constexpr):  # fmt: skip
    """One request's value head, BLOCK_V of its value dims: its [Dk, BLOCK_V] slice of the state, read and written
    in its page once."""
    i_b, i_h, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    o_k, o_v = tl.arange(0, BLOCK_K), i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_k, m_v = o_k < HEAD_K, o_v < HEAD_V
    p_o = p_out + i_b * stride_ob + i_h * stride_oh + o_v
    state_id = tl.load(p_ids + i_b).to(tl.int64)
    if state_id < 0:  # a padding row: no state to touch
        tl.store(p_o, tl.zeros([BLOCK_V], dtype=tl.float32).to(p_out.dtype.element_ty), mask=m_v)
        return
    i_hk = i_h // group
    q = tl.load(p_q + i_b * stride_qb + i_hk * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
    k = tl.load(p_k + i_b * stride_kb + i_hk * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
    q = _l2_normalised(q) * scale
    k = _l2_normalised(k)
    v = tl.load(p_v + i_b * stride_vb + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(p_g + i_b * stride_gb + i_h).to(tl.float32))
    beta = tl.load(p_beta + i_b * stride_betab + i_h).to(tl.float32)
    p_s = p_ssm + state_id * stride_page + i_h * HEAD_K * HEAD_V + o_k[:, None] * HEAD_V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    state = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32) * decay  # [Dk, BV]
    delta = (v - tl.sum(state * k[:, None], 0)) * beta  # [BV]
    state = state + k[:, None] * delta[None, :]
    tl.store(p_o, tl.sum(state * q[:, None], 0).to(p_out.dtype.element_ty), mask=m_v)
    tl.store(p_s, state.to(p_ssm.dtype.element_ty), mask=m_s)


@triton.jit
def _causal_conv1d_step_kernel(p_x, p_conv, p_ids, p_weight, p_bias, p_out, num_channels, stride_page, stride_xb,
                               stride_ob,
                               WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
                               HAS_BIAS: tl.constexpr):  # fmt: skip
    """BLOCK_C channels of one request: the window of its W - 1 kept inputs and the new one, SiLU of the conv, and
    the history shifted by one in its page."""
    i_b, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c, o_w = i_c * BLOCK_C + tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_W)
    m_c = o_c < num_channels
    p_o = p_out + i_b * stride_ob + o_c
    state_id = tl.load(p_ids + i_b).to(tl.int64)
    if state_id < 0:
        tl.store(p_o, tl.zeros([BLOCK_C], dtype=tl.float32).to(p_out.dtype.element_ty), mask=m_c)
        return
    dtype = p_x.dtype.element_ty
    x = tl.load(p_x + i_b * stride_xb + o_c, mask=m_c, other=0.0)  # [BC]
    p_h = p_conv + state_id * stride_page + o_c[:, None] * (WIDTH - 1) + o_w[None, :]
    m_h = m_c[:, None] & (o_w[None, :] < WIDTH - 1)
    history = tl.load(p_h, mask=m_h, other=0.0).to(dtype)  # [BC, BW]: positions 0 .. W - 2 kept
    window = tl.where(o_w[None, :] == WIDTH - 1, x[:, None], history).to(tl.float32)  # the new input at W - 1
    weight = tl.load(p_weight + o_c[:, None] * WIDTH + o_w[None, :], mask=m_c[:, None] & (o_w[None, :] < WIDTH),
                     other=0.0).to(tl.float32)  # fmt: skip
    y = tl.sum(window * weight, 1)
    if HAS_BIAS:
        y += tl.load(p_bias + o_c, mask=m_c, other=0.0).to(tl.float32)
    tl.store(p_o, (y / (1.0 + tl.exp(-y))).to(p_out.dtype.element_ty), mask=m_c)
    # the history moves one place: kept position j takes window position j + 1
    shifted = tl.load(p_h + 1, mask=m_h & (o_w[None, :] < WIDTH - 2), other=0.0)
    shifted = tl.where(o_w[None, :] == WIDTH - 2, x[:, None].to(p_conv.dtype.element_ty), shifted)
    tl.debug_barrier()  # every lane read its history before any lane overwrites it
    tl.store(p_h, shifted, mask=m_h)


def gated_delta_step_triton(q, k, v, g, beta, ssm_view, state_ids, block_v: int = 32):
    num_requests, num_v_heads, head_v = v.shape
    head_k = k.shape[-1]
    # pages may sit further apart than a state (padded to divide the expert page); within a page, contiguous
    assert ssm_view.shape[1:] == (num_v_heads, head_k, head_v) and ssm_view.stride()[1:] == (head_k * head_v, head_v, 1)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and g.stride(-1) == beta.stride(-1) == 1
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_requests:
        grid = (num_requests, num_v_heads, triton.cdiv(head_v, block_v))
        _gated_delta_step_kernel[grid](q, k, v, g, beta, ssm_view, state_ids, out, num_v_heads,
                                       num_v_heads // k.shape[1], ssm_view.stride(0), q.stride(0), q.stride(1),
                                       k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
                                       out.stride(0), out.stride(1), head_k**-0.5, HEAD_K=head_k, HEAD_V=head_v, BLOCK_V=block_v,
                                       BLOCK_K=triton.next_power_of_2(head_k))  # fmt: skip
    return out


def causal_conv1d_step_triton(x, conv_view, state_ids, weight, bias, block_c: int = 128):
    num_requests, num_channels = x.shape
    width = weight.shape[1]
    assert conv_view.shape[1:] == (num_channels, width - 1) and conv_view.stride()[1:] == (width - 1, 1) and width >= 2
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_requests:
        grid = (num_requests, triton.cdiv(num_channels, block_c))
        _causal_conv1d_step_kernel[grid](x, conv_view, state_ids, weight, bias if bias is not None else weight, out,
                                         num_channels, conv_view.stride(0), x.stride(0), out.stride(0), WIDTH=width,
                                         BLOCK_W=triton.next_power_of_2(width), BLOCK_C=block_c,
                                         HAS_BIAS=bias is not None)  # fmt: skip
    return out


@gated_delta_step.register_kernel("cuda")
def _gated_delta_step_cuda(q, k, v, g, beta, ssm_view, state_ids):
    return gated_delta_step_triton(q, k, v, g, beta, state_pages(ssm_view), state_ids)


@causal_conv1d_step.register_kernel("cuda")
def _causal_conv1d_step_cuda(x, conv_view, state_ids, weight, bias):
    return causal_conv1d_step_triton(x, conv_view, state_ids, weight, bias)


@functools.cache
def _fla_chunk_gated_delta_rule():
    """flash-linear-attention's chunked delta rule, or None where the package is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def gated_delta_prefill_fla(q, k, v, g, beta, ssm_view, state_ids, query_start_loc, continues):
    """The packed batch through flash-linear-attention (its q/k L2 norm, scale Dk^-0.5 and grouped value heads are
    the reference's): each request's state gathered from its page (zero where it starts), written back once."""
    ids = state_ids.long()
    # where: a new request's page holds whatever its last owner left, NaN included, which a product by 0 keeps
    initial = torch.where(continues[:, None, None, None], ssm_view[ids].float(), 0.0)  # [B, Hv, Dk, Dv]
    q, k, v, beta = (x.contiguous()[None] for x in (q, k, v, beta))  # [1, T, H, ...]: one packed sequence batch
    # query_start_loc as it comes (fla loads it as int64): the same tensor in every layer of a pass, so fla's
    # identity cache of its chunk indices reads the lengths on the host at the first linear layer only
    out, final = _fla_chunk_gated_delta_rule()(q, k, v, g.float().contiguous()[None], beta, initial_state=initial,
                                               output_final_state=True, use_qk_l2norm_in_kernel=True,
                                               cu_seqlens=query_start_loc)  # fmt: skip
    ssm_view[ids] = final.to(ssm_view.dtype)
    return out[0].to(v.dtype)


def causal_conv1d_prefill_gathered(x, conv_view, state_ids, query_start_loc, continues, weight, bias):
    """The packed batch's conv in a few gathers, no loop over requests: each token's window of W inputs picked
    from the batch's inputs and the requests' kept histories (zero where a request starts), and each request's
    last W - 1 inputs written back to its page."""
    num_tokens, channels = x.shape
    width, dev = weight.shape[1], x.device
    keep, starts = width - 1, query_start_loc.long()
    lengths, num_requests = starts.diff(), len(state_ids)
    live = (state_ids >= 0) & (lengths > 0)
    history = conv_view[state_ids.clamp(min=0).long()].to(x.dtype)  # [B, C, W-1]
    history = torch.where((continues & live)[:, None, None], history, 0.0)  # a page's old bytes may be NaN
    source = torch.cat([x, history.transpose(1, 2).reshape(num_requests * keep, channels)])  # [T + B (W-1), C]

    def rows(request, position):  # input `position` of `request` (< 0: from its history) as a row of `source`
        return torch.where(position >= 0, starts[request] + position,
                           num_tokens + request * keep + keep + position)  # fmt: skip

    request = torch.repeat_interleave(torch.arange(num_requests, device=dev), lengths)  # [T]
    offset = torch.arange(num_tokens, device=dev) - starts[request]  # [T] a token's place in its request's chunk
    taps = torch.arange(width, device=dev) - keep  # [W]
    window = source[rows(request[:, None], offset[:, None] + taps)]  # [T, W, C]
    y = (window.float() * weight.float().T).sum(1) + (0 if bias is None else bias.float())  # [T, C]
    out = torch.nn.functional.silu(y).to(x.dtype) * live[request][:, None]
    kept = rows(torch.arange(num_requests, device=dev)[:, None], lengths[:, None] + taps[:-1])  # [B, W-1]
    conv_view[state_ids[live].long()] = source[kept[live]].transpose(1, 2).to(conv_view.dtype)
    return out


@gated_delta_prefill.register_kernel("cuda")
def _gated_delta_prefill_cuda(q, k, v, g, beta, ssm_view, state_ids, query_start_loc, continues):
    ssm_view = state_pages(ssm_view)
    # flash-linear-attention multiplies in TF32 at fp32: an fp32 model keeps the reference's exact products.
    # NOTE: no padding rows (state id -1) reach a prompt step: only decode shapes of a hybrid are captured
    # (`rimuru.graph_inputs`), and their linear layers take the step ops
    if _fla_chunk_gated_delta_rule() is None or q.dtype == torch.float32:
        return reference.gated_delta_prefill(q, k, v, g, beta, ssm_view, state_ids, query_start_loc, continues)
    return gated_delta_prefill_fla(q, k, v, g, beta, ssm_view, state_ids, query_start_loc, continues)


@causal_conv1d_prefill.register_kernel("cuda")
def _causal_conv1d_prefill_cuda(x, conv_view, state_ids, query_start_loc, continues, weight, bias):
    return causal_conv1d_prefill_gathered(x, conv_view, state_ids, query_start_loc, continues, weight, bias)
