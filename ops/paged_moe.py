"""`rimuru::paged_moe`: the routed-expert MLP read straight from pool pages (docs/architecture.md, Expert tiers).

Owns two Triton kernels and their launcher. `_gate_up_kernel` computes, for one M tile of an expert's sorted
tokens and one N tile of the F features, both the gate and the up tile (each from its own page: the two are never
concatenated) and stores silu(gate) * up. `_down_kernel` multiplies that by the down page, scales each row by its
router weight in fp32 and writes one row per (token, k); the sum over k is `rimuru.ops.topk_sum` (fixed order, no
atomics). Token sorting lives in `rimuru.ops.moe_align`; a single token skips it (`gemm_layout`: one M block a
pair, its expert read from the top-k ids). Where a tuned config says `PDL`, every launch of the op is dependent on
the one before it (`rimuru.ops.dependent_launch`). The reference is `rimuru.ops.reference.paged_moe`.

Addresses inside the expert view (row stride `stride_page` >= F * D, so padded pools work):

    gate/up element (n, k)  ->  base + page(e, 0 or 1) * stride_page + n * D + k      n < F, k < D
    down    element (n, t)  ->  base + page(e, 2)      * stride_page + n * F + t      n < D, t < F

An expert whose pages are -1 (on the host) contributes zero rows and is never read, unless the call passes the
layer's pinned host copies (`host_gate`, `host_up`, `host_down`): then the kernels read that expert there, over the
host link (device-mapped pinned memory, no copy and no host synchronisation):

    gate/up element (n, k)  ->  host_gate/up + e * F * D + n * D + k
    down    element (n, t)  ->  host_down    + e * D * F + n * F + t

The GEMMs run near the memory roofline from a few dozen tokens on, and the paged table costs about as much as an
identity table (docs/benchmarks/kernels.md).
"""

import torch
import triton
import triton.language as tl

from rimuru.ops import reference
from rimuru.ops.configs import moe_config
from rimuru.ops.dependent_launch import launch_options, pdl_supported, wait_for_prior_grid
from rimuru.ops.exact_dot import dot
from rimuru.ops.moe_align import gemm_layout
from rimuru.ops.topk_sum import topk_sum


@triton.jit
def _block_rows(i_m, p_sorted_ids, p_block_expert, num_pairs, BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """(expert, [BM] flat (token, k) ids, padded with num_pairs) of M block i_m. PAIR_BLOCKS: block i_m is pair
    i_m alone and `p_block_expert` holds the flat top-k ids (one token's ids are distinct: nothing to sort)."""
    i_e = tl.load(p_block_expert + i_m).to(tl.int64)
    if PAIR_BLOCKS:
        b_pair = tl.where(tl.arange(0, BLOCK_M) == 0, i_m, num_pairs)
    else:
        b_pair = tl.load(p_sorted_ids + i_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return i_e, b_pair


@triton.jit
def _tile_ids(num_m_blocks, num_n_tiles, GROUP_M: tl.constexpr):
    """(M block, N tile) of this program of a 1-D grid. GROUP_M 0: M blocks fastest, so programs running together
    share an N tile of the weights (an expert's M blocks read it once between them). GROUP_M g: g M blocks sweep
    every N tile before the next g start, so their activation rows stay in L2 across the N tiles (vLLM's grouped
    order; at thousands of tokens the rows of one N tile's M blocks outgrow L2)."""
    pid = tl.program_id(0)
    if GROUP_M == 0:
        return pid % num_m_blocks, pid // num_m_blocks
    in_group = GROUP_M * num_n_tiles
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_size, (pid % in_group) // group_size


@triton.jit
def _program_tile(num_m_blocks, num_n_tiles, p_num_padded, BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
                  GROUP_M: tl.constexpr):  # fmt: skip
    """(M block, N tile, live) of this program: not live for a padding block past the sorted pairs (the buffers are
    sized for the worst case), whose program returns before it loads anything else. Pair blocks are all live (the
    same comparison's type either way: one compiled form of the caller's early return)."""
    i_m, i_n = _tile_ids(num_m_blocks, num_n_tiles, GROUP_M)
    if PAIR_BLOCKS:
        return i_m, i_n, i_m < num_m_blocks
    return i_m, i_n, i_m * BLOCK_M < tl.load(p_num_padded)


@triton.jit(do_not_specialize=["num_pairs", "top_k", "num_m_blocks"])  # one compile serves every batch and top-k
def _gate_up_kernel(
    p_hidden, p_experts, p_page_table, p_sorted_ids, p_block_expert, p_num_padded, p_act, p_host_gate, p_host_up,
    num_pairs, top_k, num_features, hidden_size, stride_hidden, stride_page, stride_act, num_m_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, READ_HOST: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr, GROUP_M: tl.constexpr, USE_PDL: tl.constexpr, WEIGHT_EVICT: tl.constexpr,
    ROW_EVICT: tl.constexpr,
):
    wait_for_prior_grid(USE_PDL)
    i_m, i_n, live = _program_tile(num_m_blocks, tl.cdiv(num_features, BLOCK_N), p_num_padded, BLOCK_M, PAIR_BLOCKS,
                                   GROUP_M)  # fmt: skip
    if not live:
        return
    i_e, b_pair = _block_rows(i_m, p_sorted_ids, p_block_expert, num_pairs, BLOCK_M, PAIR_BLOCKS)
    m_m = b_pair < num_pairs
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < num_features
    o_k = tl.arange(0, BLOCK_K)
    p_a = p_hidden + (b_pair // top_k)[:, None] * stride_hidden + o_k[None, :]  # [BM, BK]
    page_gate = tl.load(p_page_table + i_e * 3).to(tl.int64)
    page_up = tl.load(p_page_table + i_e * 3 + 1).to(tl.int64)
    o_w = o_n[None, :] * hidden_size + o_k[:, None]  # [BK, BN]: column n of the GEMM is row n of the page
    if READ_HOST:
        if page_gate >= 0:
            p_g = p_experts + page_gate * stride_page + o_w
            p_u = p_experts + page_up * stride_page + o_w
        else:  # the expert's pinned host copy, read over the host link
            p_g = p_host_gate + i_e * num_features * hidden_size + o_w
            p_u = p_host_up + i_e * num_features * hidden_size + o_w
    else:
        if page_gate < 0:  # not in the pool: `_down_kernel` writes its rows' zeros without reading act
            return
        p_g = p_experts + page_gate * stride_page + o_w
        p_u = p_experts + page_up * stride_page + o_w
    b_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden_size, BLOCK_K)):
        m_k = o_k < hidden_size - k * BLOCK_K
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0, eviction_policy=ROW_EVICT)
        m_w = m_k[:, None] & m_n[None, :]
        b_gate = dot(b_a, tl.load(p_g, mask=m_w, other=0.0, eviction_policy=WEIGHT_EVICT), b_gate)
        b_up = dot(b_a, tl.load(p_u, mask=m_w, other=0.0, eviction_policy=WEIGHT_EVICT), b_up)
        p_a += BLOCK_K
        p_g += BLOCK_K
        p_u += BLOCK_K
    b_act = b_gate * tl.sigmoid(b_gate) * b_up
    p_out = p_act + b_pair[:, None] * stride_act + o_n[None, :]
    tl.store(p_out, b_act.to(p_act.dtype.element_ty), mask=m_m[:, None] & m_n[None, :], eviction_policy=ROW_EVICT)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _down_kernel(
    p_act, p_experts, p_page_table, p_sorted_ids, p_block_expert, p_num_padded, p_weights, p_out, p_host_down,
    num_pairs, num_features, hidden_size, stride_act, stride_page, stride_out, num_m_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, READ_HOST: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr, GROUP_M: tl.constexpr, USE_PDL: tl.constexpr, WEIGHT_EVICT: tl.constexpr,
    ROW_EVICT: tl.constexpr,
):
    wait_for_prior_grid(USE_PDL)
    i_m, i_n, live = _program_tile(num_m_blocks, tl.cdiv(hidden_size, BLOCK_N), p_num_padded, BLOCK_M, PAIR_BLOCKS,
                                   GROUP_M)  # fmt: skip
    if not live:
        return
    i_e, b_pair = _block_rows(i_m, p_sorted_ids, p_block_expert, num_pairs, BLOCK_M, PAIR_BLOCKS)
    m_m = b_pair < num_pairs
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < hidden_size
    o_k = tl.arange(0, BLOCK_K)
    p_a = p_act + b_pair[:, None] * stride_act + o_k[None, :]  # [BM, BK]
    page_down = tl.load(p_page_table + i_e * 3 + 2).to(tl.int64)
    p_y = p_out + b_pair[:, None] * stride_out + o_n[None, :]
    o_w = o_n[None, :] * num_features + o_k[:, None]  # [BK, BN]
    if READ_HOST:
        if page_down >= 0:
            p_w = p_experts + page_down * stride_page + o_w
        else:
            p_w = p_host_down + i_e * hidden_size * num_features + o_w
    else:
        if page_down < 0:  # NOTE: an expert not in the pool adds nothing and is never read (a safety net)
            b_zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=p_out.dtype.element_ty)
            tl.store(p_y, b_zero, mask=m_m[:, None] & m_n[None, :])
            return
        p_w = p_experts + page_down * stride_page + o_w
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(num_features, BLOCK_K)):
        m_k = o_k < num_features - k * BLOCK_K
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0, eviction_policy=ROW_EVICT)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0, eviction_policy=WEIGHT_EVICT)
        b_acc = dot(b_a, b_w, b_acc)
        p_a += BLOCK_K
        p_w += BLOCK_K
    b_weight = tl.load(p_weights + b_pair, mask=m_m, other=0.0).to(tl.float32)  # router weights in fp32
    b_acc = b_acc * b_weight[:, None]
    tl.store(p_y, b_acc.to(p_out.dtype.element_ty), mask=m_m[:, None] & m_n[None, :], eviction_policy=ROW_EVICT)


def launch_gate_up(hidden, expert_view, page_table, sorted_ids, block_expert, num_padded, act, top_k, cfg,
                   host=None):  # fmt: skip
    """act[t * K + k] = silu(x_t gate_e^T) * (x_t up_e^T) for every routed pair; act [T * K, F]. `sorted_ids`
    None: one block a pair, `block_expert` the flat top-k ids (`moe_align.pair_blocks`)."""
    num_pairs, num_features = act.shape
    num_m_blocks = block_expert.numel()
    grid = (num_m_blocks * triton.cdiv(num_features, cfg["BLOCK_N"]),)
    host_gate, host_up, _ = host or (expert_view,) * 3  # without host copies the pointers are never read
    sorted_ids, num_padded, pair_blocks = _layout_pointers(sorted_ids, block_expert, num_padded)
    _gate_up_kernel[grid](
        hidden, expert_view, page_table, sorted_ids, block_expert, num_padded, act, host_gate, host_up,
        num_pairs, top_k, num_features, hidden.shape[1], hidden.stride(0), expert_view.stride(0), act.stride(0),
        num_m_blocks, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        READ_HOST=host is not None, PAIR_BLOCKS=pair_blocks, GROUP_M=cfg.get("GROUP_M", 0),
        USE_PDL=cfg.get("PDL", False), **_l2_hints(cfg), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **launch_options(cfg.get("PDL", False)),
    )


def launch_down(act, expert_view, page_table, sorted_ids, block_expert, num_padded, weights, out, cfg, host=None):
    """out[t * K + k] = w_tk * (act[t * K + k] down_e^T); out [T * K, D]. `DOWN_*` keys override the tiles (and
    `GROUP_M`, the program order: `_tile_ids`)."""
    tiles = {**cfg, **{key[5:]: v for key, v in cfg.items() if key.startswith("DOWN_")}}
    num_pairs, num_features = act.shape
    num_m_blocks = block_expert.numel()
    grid = (num_m_blocks * triton.cdiv(out.shape[1], tiles["BLOCK_N"]),)
    host_down = host[2] if host is not None else expert_view
    sorted_ids, num_padded, pair_blocks = _layout_pointers(sorted_ids, block_expert, num_padded)
    _down_kernel[grid](
        act, expert_view, page_table, sorted_ids, block_expert, num_padded, weights, out, host_down,
        num_pairs, num_features, out.shape[1], act.stride(0), expert_view.stride(0), out.stride(0), num_m_blocks,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"], BLOCK_K=tiles["BLOCK_K"], READ_HOST=host is not None,
        PAIR_BLOCKS=pair_blocks, GROUP_M=tiles.get("GROUP_M", 0), USE_PDL=cfg.get("PDL", False), **_l2_hints(cfg),
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"], **launch_options(cfg.get("PDL", False)),
    )


def _l2_hints(cfg: dict) -> dict:
    """The GEMMs' L2 eviction hints where a tuned config says `L2_HINTS`: expert weights, each read by an expert's
    few M blocks close together, go first; the token rows (hidden, act, the K output rows the top-k sum reads next)
    stay. At Qwen3's M = 1024 the down GEMM streams 403 MB of weights through a 50 MB L2 and then the sum reads back
    33.5 MB of rows. No value changes; without the key both hints are the default."""
    if not cfg.get("L2_HINTS", False):
        return {"WEIGHT_EVICT": "", "ROW_EVICT": ""}
    return {"WEIGHT_EVICT": "evict_first", "ROW_EVICT": "evict_last"}


def _layout_pointers(sorted_ids, block_expert, num_padded):
    """(sorted ids, padded count, PAIR_BLOCKS) for a launch: with pair blocks the first two are never read."""
    if sorted_ids is None:
        return block_expert, block_expert, True
    return sorted_ids, num_padded, False


def moe_gemms(hidden, expert_view, page_table, topk_weights, sorted_ids, block_expert, num_padded, num_features,
              cfg, host=None):  # fmt: skip
    """Both GEMMs over already sorted pairs: one weighted output row per (token, k), [T * K, D]."""
    num_tokens, hidden_size = hidden.shape
    num_pairs = topk_weights.numel()
    act = torch.empty(num_pairs, num_features, dtype=hidden.dtype, device=hidden.device)  # [T * K, F]
    out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)  # [T * K, D]
    launch_gate_up(hidden, expert_view, page_table, sorted_ids, block_expert, num_padded, act,
                   num_pairs // num_tokens, cfg, host)  # fmt: skip
    launch_down(act, expert_view, page_table, sorted_ids, block_expert, num_padded, topk_weights, out, cfg, host)
    return out


def paged_moe_triton(
    hidden: torch.Tensor,  # [T, D]
    expert_view: torch.Tensor,  # [P, F * D], rows may be padded (stride(0) >= F * D)
    page_table: torch.Tensor,  # [E, 3] int32
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K] float32
    num_features: int,
    config: dict | None = None,
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # pinned gate, up [E, F, D], down [E, D, F]
) -> torch.Tensor:  # [T, D]
    """Sort (none for one token), both GEMMs and the top-k sum; no host synchronisation. With `host`, experts whose
    pages are -1 are read from their pinned host copies (device-mapped memory) instead of contributing nothing."""
    num_tokens, hidden_size = hidden.shape
    num_experts, top_k = page_table.shape[0], topk_ids.shape[1]
    if num_tokens == 0:
        return hidden.new_empty(0, hidden_size)
    assert expert_view.stride(1) == 1 and hidden.stride(1) == 1, "pages and hidden rows must be contiguous"
    cfg = config or moe_config(num_tokens, num_experts, num_features, hidden_size, top_k, hidden.device,
                               hidden.element_size())  # fmt: skip
    pdl = cfg.get("PDL", False) and pdl_supported(hidden.device)  # tuned per M: each launch dependent
    cfg = {**cfg, "PDL": pdl}
    sorted_ids, block_expert, num_padded = gemm_layout(topk_ids, num_experts, cfg["BLOCK_M"], cfg.get("PAIR_BLOCKS"),
                                                       cfg.get("ATOMIC_SORT", False), pdl)  # fmt: skip
    # NOTE: no-ops (no launch) for what the model passes, fp32 weights from torch.topk and the int32 page table
    weights = topk_weights.to(torch.float32).contiguous()
    out = moe_gemms(hidden, expert_view, page_table.to(torch.int32).contiguous(), weights, sorted_ids,
                    block_expert, num_padded, num_features, cfg, host)  # [T * K, D]
    if top_k == 1:
        return out
    return topk_sum(out.view(num_tokens, top_k, hidden_size), pdl=pdl)  # [T, D], fp32 accumulation in k order


@torch.library.custom_op("rimuru::paged_moe", mutates_args=(), device_types="cpu")
def paged_moe(
    hidden: torch.Tensor,
    expert_view: torch.Tensor,
    page_table: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_features: int,
    host_gate: torch.Tensor | None = None,
    host_up: torch.Tensor | None = None,
    host_down: torch.Tensor | None = None,
) -> torch.Tensor:
    host = _host(host_gate, host_up, host_down)
    return reference.paged_moe(hidden, expert_view, page_table, topk_ids, topk_weights, num_features, host)


@paged_moe.register_kernel("cuda")
def _paged_moe_cuda(hidden, expert_view, page_table, topk_ids, topk_weights, num_features, host_gate=None,
                    host_up=None, host_down=None):  # fmt: skip
    host = _host(host_gate, host_up, host_down)
    return paged_moe_triton(hidden, expert_view, page_table, topk_ids, topk_weights, num_features, host=host)


@paged_moe.register_fake
def _paged_moe_fake(hidden, expert_view, page_table, topk_ids, topk_weights, num_features, host_gate=None,
                    host_up=None, host_down=None):  # fmt: skip
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


def _host(gate, up, down) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if gate is None and up is None and down is None:
        return None
    if gate is None or up is None or down is None:
        raise ValueError("host_gate, host_up and host_down go together")
    return gate, up, down
