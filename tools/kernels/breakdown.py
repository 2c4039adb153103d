"""Where the whole MoE op's time goes: each piece of `paged_moe_triton` timed alone under CUDA graph replay.

    python -m tools.kernels.bench --breakdown --out breakdown.json               # on a CUDA GPU, ~1 minute
    TRITON_INTERPRET=1 python -m tools.kernels.bench --breakdown --smoke         # logic check on CPU

Per model shape and M = 1, 2, 4, 8, 64, 1024, 4096 (the main benchmark's inputs), each a captured graph of:
  floor         one tiny kernel: what a graph replay costs with (almost) nothing in it
  align         align_tokens as the op runs it (0 at M = 1: one block a pair, no sort); align_paths: its other
                paths (one program sorting up to 1,024 pairs in registers, count + scatter with each scatter
                program summing the prefix or with one scan of the counts first, 128-pair chunks, the atomic sort)
  casts         topk_weights.to(fp32) and page_table.to(int32); 0 and `casts_noop` when both return their input
  gate_up, down each GEMM kernel over pre-sorted pairs; gemms: both, as `moe_gemms` runs them; pair_block_gemms
                (1 < M <= 8): both over one block a pair, unsorted (repeated experts read twice, or from L2)
  sum_torch     torch's `.sum(1)` over [T, K, D]; sum_triton: `rimuru.ops.topk_sum` (plus other tiles at M >= 1024)
  op            the whole op as wired by default; op_torch_sum and op_triton_sum: with each top-k sum
  op_atomic_sort  (where the op sorts) the op with the atomic sort (`ATOMIC_SORT`), op_counted_sort without it (one
                of the two is `op`, as the table says); atomic_sort_equal: both give exactly the same values
  op_pdl        the op with every launch dependent on the one before it (`PDL`), op_plain_launch without; pdl_equal
  op_l2_hints   the op with the GEMMs' L2 eviction hints (`L2_HINTS`), op_no_hints without; l2_hints_equal
  op_layers     (M = 1 and 8) the op's share of a graph of 8 calls over 8 expert pools, as a step's graph holds it
                (the replay paid once, no weights shared in L2); at M = 1 also as a share of the copy rate
  unexplained   op_torch_sum - (align + gemms + sum_torch) + 2 * floor   (three pieces paid one floor each, the op one;
                1 * floor at M = 1, where no sort is timed)
Times are medians of CUDA events around graph replays (triton.testing.do_bench: L2 flushed before each replay, so
each piece starts cold where in the op its input may still sit in L2). Does not own the main tables
(`tools/kernels/bench.py`).
"""

import contextlib
import importlib

import torch
import triton

from rimuru.ops.configs import moe_config
from rimuru.ops.moe_align import (
    CHUNK,
    MAX_SORT_PROGRAMS,
    ONE_PROGRAM_MAX_PAIRS,
    SORTED_PROGRAM_PAIRS,
    align_tokens,
    align_tokens_triton,
    count_chunk,
    gemm_layout,
    pair_blocks,
    scans_counts,
    sort_chunks,
    uses_pair_blocks,
)
from rimuru.ops.paged_moe import launch_down, launch_gate_up, moe_gemms, paged_moe_triton
from rimuru.ops.topk_sum import topk_sum_triton
from tools.kernels.bench import MODELS, expert_pools, routing, time_ms

BREAKDOWN_M = [1, 2, 4, 8, 64, 1024, 4096]
PAIR_BLOCK_M = 8  # up to this M the GEMMs are timed over pair blocks too (`pair_blocks`: no sort)
LAYER_CALLS, LAYER_CALLS_M = 8, (1, 8)  # at these M the op is also timed as 8 calls in one graph, a pool each
SUM_TILES = [{"BLOCK_D": 2048, "num_warps": 8}, {"BLOCK_D": 512, "num_warps": 4}, {"BLOCK_D": 1024, "num_warps": 8}]


def time_graph_us(fn, smoke):
    """Median us of replaying a graph that holds one call of `fn` (a plain timed call in smoke mode)."""
    if smoke:
        return 1e3 * time_ms(fn, smoke=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles and warms the allocator outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    import triton.testing

    return 1e3 * triton.testing.do_bench(graph.replay, warmup=5, rep=20, return_mode="median")


@contextlib.contextmanager
def wired_topk_sum(sum_fn):
    """The op with `sum_fn` as its top-k sum (torch's `.sum(1)` or the Triton kernel), whatever the default."""
    paged_moe_module = importlib.import_module("rimuru.ops.paged_moe")  # the attribute is the op, not the module
    wired = paged_moe_module.topk_sum
    paged_moe_module.topk_sum = sum_fn
    try:
        yield
    finally:
        paged_moe_module.topk_sum = wired


def point_inputs(shape, num_tokens, device, dtype):
    ids, weights = routing(num_tokens, shape, device, seed=num_tokens)
    hidden = torch.randn(num_tokens, shape["D"], device=device, dtype=dtype)
    cfg = moe_config(num_tokens, shape["E"], shape["F"], shape["D"], shape["K"], device)
    return ids, weights, hidden, cfg


def time_align(row, ids, shape, cfg, smoke):
    """The op's sort, then the other paths where they apply: one program (up to 1,024 pairs), count + scatter with the
    prefix summed in each scatter program or scanned once, 128-pair tiles where the op takes smaller ones, and half
    or twice the programs where the op's programs take several tiles."""
    num_pairs, num_experts = ids.numel(), shape["E"]
    tile, experts_pad = count_chunk(num_pairs, num_experts), triton.next_power_of_2(num_experts)
    pairs_each, num_chunks = sort_chunks(num_pairs, tile)
    if uses_pair_blocks(ids.shape[0], cfg.get("PAIR_BLOCKS")):  # one block a pair (`gemm_layout`): no sort
        row["align_us"], row["align_path"] = 0.0, "pair blocks, no sort"
    else:
        row["align_us"] = time_graph_us(lambda: align_tokens(ids, num_experts, cfg["BLOCK_M"]), smoke)
        row["align_path"] = "one program" if num_pairs <= SORTED_PROGRAM_PAIRS else \
            f"count + {'scan + ' if scans_counts(num_chunks, experts_pad) else ''}scatter, {num_chunks} programs of " \
            f"{pairs_each // tile} {tile}-pair tile(s)"
    paths = {}
    if num_pairs <= ONE_PROGRAM_MAX_PAIRS:
        paths["one program"] = {"one_program": True}
    paths["count + scatter"] = {"one_program": False, "scan": False}
    paths["atomic count + scatter"] = {"atomic": True}  # runs in any order (`_atomic_count_and_scatter`)
    paths["count + scan + scatter"] = {"one_program": False, "scan": True}
    if tile != CHUNK:  # the smaller tiles the op takes, against 128-pair ones
        paths[f"count + scatter, {CHUNK}-pair tiles"] = {"one_program": False, "scan": False, "chunk": CHUNK}
        paths[f"count + scan + scatter, {CHUNK}-pair tiles"] = {"one_program": False, "scan": True, "chunk": CHUNK}
    if pairs_each > tile or smoke:  # programs of several tiles: fewer of them, or more
        for programs in (MAX_SORT_PROGRAMS // 2, 2 * MAX_SORT_PROGRAMS):
            paths[f"count + scan + scatter, {programs} programs at most"] = {
                "one_program": False, "scan": True, "max_programs": programs}
    row["align_paths_us"] = {name: time_graph_us(
        lambda kw=kw: align_tokens_triton(ids, num_experts, cfg["BLOCK_M"], **kw), smoke) for name, kw in paths.items()}


def time_casts(row, weights, table, smoke):
    cast = lambda: (weights.to(torch.float32).contiguous(), table.to(torch.int32).contiguous())  # noqa: E731
    same = [a.data_ptr() == b.data_ptr() for a, b in zip(cast(), (weights, table))]
    row["casts_noop"] = all(same)
    row["casts_us"] = 0.0 if row["casts_noop"] else time_graph_us(cast, smoke)


def time_gemms(row, hidden, pool, table, weights, aligned, shape, cfg, smoke):
    num_pairs = weights.numel()
    act = torch.empty(num_pairs, shape["F"], device=hidden.device, dtype=hidden.dtype)
    out = torch.empty(num_pairs, shape["D"], device=hidden.device, dtype=hidden.dtype)
    launch_gate_up(hidden, pool, table, *aligned, act, shape["K"], cfg)  # act holds real values for the down run
    row["gate_up_us"] = time_graph_us(lambda: launch_gate_up(hidden, pool, table, *aligned, act, shape["K"], cfg),
                                      smoke)
    row["down_us"] = time_graph_us(lambda: launch_down(act, pool, table, *aligned, weights, out, cfg), smoke)
    row["gemms_us"] = time_graph_us(lambda: moe_gemms(hidden, pool, table, weights, *aligned, shape["F"], cfg), smoke)
    return out


def time_sums(row, out, shape, smoke, copy_tb_per_s):
    pairs = out.view(-1, shape["K"], shape["D"])  # [T, K, D]
    moved = pairs.numel() * pairs.element_size() * (1 + 1 / shape["K"])  # read [T, K, D], write [T, D]
    row["sum_torch_us"] = time_graph_us(lambda: pairs.sum(1), smoke)
    row["sum_triton_us"] = time_graph_us(lambda: topk_sum_triton(pairs), smoke)
    if pairs.shape[0] >= 1024 or smoke:
        row["sum_triton_tiles_us"] = {f"{t['BLOCK_D']}/{t['num_warps']}w": time_graph_us(
            lambda t=t: topk_sum_triton(pairs, t), smoke) for t in SUM_TILES}
    if copy_tb_per_s:
        for key in ("sum_torch", "sum_triton"):
            row[f"{key}_of_copy"] = moved / (row[f"{key}_us"] * 1e6) / copy_tb_per_s
    ref = pairs.float().sum(1)
    row["sum_triton_max_abs_diff"] = (topk_sum_triton(pairs).float() - ref).abs().max().item()


def breakdown_point(name, shape, num_tokens, pools, device, dtype, smoke, copy_tb_per_s, floor_us):
    pool, table = pools[0], pools[1]
    ids, weights, hidden, cfg = point_inputs(shape, num_tokens, device, dtype)
    row = {"model": name, "M": num_tokens, "pairs": ids.numel(), "config": cfg, "floor_us": floor_us}
    time_align(row, ids, shape, cfg, smoke)
    time_casts(row, weights, table, smoke)
    aligned = gemm_layout(ids, shape["E"], cfg["BLOCK_M"])  # the op's blocks
    out = time_gemms(row, hidden, pool, table, weights, aligned, shape, cfg, smoke)
    if 1 < num_tokens <= PAIR_BLOCK_M:  # does skipping the sort pay here too? (the op does it at M = 1)
        unsorted = pair_blocks(ids)
        row["pair_block_gemms_us"] = time_graph_us(
            lambda: moe_gemms(hidden, pool, table, weights, *unsorted, shape["F"], cfg), smoke)
        for pairs in (False, True):  # the whole op either way (the tuner's `PAIR_BLOCKS` choice)
            row[f"op_pair_blocks_{str(pairs).lower()}_us"] = time_graph_us(lambda pairs=pairs: paged_moe_triton(
                hidden, pool, table, ids, weights, shape["F"], {**cfg, "PAIR_BLOCKS": pairs}), smoke)
    time_sums(row, out, shape, smoke, copy_tb_per_s)
    whole = lambda: paged_moe_triton(hidden, pool, table, ids, weights, shape["F"])  # noqa: E731
    row["op_us"] = time_graph_us(whole, smoke)  # as wired by default
    outputs = {}
    for label, sum_fn in (("torch_sum", lambda pairs, pdl: pairs.sum(1)), ("triton_sum", topk_sum_triton)):
        with wired_topk_sum(sum_fn):
            row[f"op_{label}_us"] = time_graph_us(whole, smoke)
            outputs[label] = whole().float()
    ref = outputs["torch_sum"]
    row["op_rel_diff_vs_torch_sum"] = ((outputs["triton_sum"] - ref).norm() / ref.norm()).item()
    for key in OP_CHOICES if row["align_us"] else ("PDL", "L2_HINTS"):
        time_op_choice(row, key, hidden, pool, table, ids, weights, shape, cfg, smoke)
    if num_tokens in LAYER_CALLS_M or smoke:
        time_layer_calls(row, hidden, ids, weights, pools, shape, device, dtype, smoke, copy_tb_per_s)
    pieces = row["align_us"] + row["casts_us"] + row["gemms_us"] + row["sum_torch_us"]
    floors = 2 if row["align_us"] else 1  # pieces timed alone, less the op's own replay
    row["unexplained_us"] = row["op_torch_sum_us"] - pieces + floors * floor_us
    return row


# the config keys the op is timed with on and off: (on, off, whether both give exactly the same values)
OP_CHOICES = {
    "ATOMIC_SORT": ("op_atomic_sort_us", "op_counted_sort_us", "atomic_sort_equal"),  # where the op sorts
    "PDL": ("op_pdl_us", "op_plain_launch_us", "pdl_equal"),  # where the device cannot, both are the plain op
    "L2_HINTS": ("op_l2_hints_us", "op_no_hints_us", "l2_hints_equal"),  # the GEMMs' L2 eviction hints
}


def time_op_choice(row, key, hidden, pool, table, ids, weights, shape, cfg, smoke):
    """The op with the config's `key` on and off, whichever the tuned table wires into `op_us`, and whether the two
    give exactly the same values (`OP_CHOICES` names the fields)."""
    def op(on):
        cfg_now = {**cfg, key: on}
        return lambda: paged_moe_triton(hidden, pool, table, ids, weights, shape["F"], cfg_now)

    on_us, off_us, equal = OP_CHOICES[key]
    row[on_us] = time_graph_us(op(True), smoke)
    row[off_us] = time_graph_us(op(False), smoke)
    row[equal] = bool(torch.equal(op(True)(), op(False)()))


def time_layer_calls(row, hidden, ids, weights, pools, shape, device, dtype, smoke, copy_tb_per_s):
    """The op's share of a graph of LAYER_CALLS calls, each over an expert pool of its own, as a decode step's graph
    holds one a layer: the replay's own cost is paid once, and no call finds another's weights in L2. At M = 1 also
    as a share of the copy rate over the routed experts' bytes (the memory roofline)."""
    layers = [pools[:2]] + [expert_pools(shape, device, dtype, seed=i)[:2] for i in range(1, LAYER_CALLS)]
    def calls():
        return [paged_moe_triton(hidden, pool, table, ids, weights, shape["F"]) for pool, table in layers]

    row["op_layers_us"] = time_graph_us(calls, smoke) / LAYER_CALLS
    if copy_tb_per_s and ids.shape[0] == 1:
        routed = ids.numel() * 3 * shape["F"] * shape["D"] * pools[0].element_size()
        row["op_layers_of_copy"] = routed / (row["op_layers_us"] * 1e6) / copy_tb_per_s


def graph_floor_us(device, smoke):
    tiny = torch.zeros(1, device=device)
    return time_graph_us(lambda: tiny.add_(1), smoke)


def run_breakdown(device, dtype, smoke, copy_tb_per_s=None):
    models = {"tiny": {"E": 6, "F": 40, "D": 72, "K": 2}} if smoke else MODELS
    floor_us = graph_floor_us(device, smoke)
    rows = []
    for name, shape in models.items():
        pools = expert_pools(shape, device, dtype)
        for m in ([1, 3, 70] if smoke else BREAKDOWN_M):
            rows.append(breakdown_point(name, shape, m, pools, device, dtype, smoke, copy_tb_per_s, floor_us))
            print_row(rows[-1], header=len(rows) == 1)
        del pools
    return rows


def print_row(r, header=False):
    if header:
        print(f"breakdown, us under CUDA graph replay (floor {r['floor_us']:.1f} us = an almost empty graph)")
        print("model M pairs | align casts | gate_up down gemms | sum torch (copy%) triton (copy%) |"
              " op op_torch_sum op_triton_sum | unexplained | sum tiles | other sort paths")
    paths = " ".join(f"{k}:{v:.1f}" for k, v in r["align_paths_us"].items())
    if "op_layers_us" in r:
        of_copy = f" ({100 * r['op_layers_of_copy']:.0f}% of copy)" if "op_layers_of_copy" in r else ""
        paths += f" | op, {LAYER_CALLS} layers a graph:{r['op_layers_us']:.1f}{of_copy}"
    if "op_atomic_sort_us" in r:
        paths += (f" | op, atomic / counted sort:{r['op_atomic_sort_us']:.1f} / {r['op_counted_sort_us']:.1f}"
                  f"{'' if r['atomic_sort_equal'] else ' (DIFFERS)'}")
    if "op_pdl_us" in r:
        paths += (f" | op, dependent / plain launches:{r['op_pdl_us']:.1f} / {r['op_plain_launch_us']:.1f}"
                  f"{'' if r['pdl_equal'] else ' (DIFFERS)'}")
        paths += (f" | op, L2 hints / none:{r['op_l2_hints_us']:.1f} / {r['op_no_hints_us']:.1f}"
                  f"{'' if r['l2_hints_equal'] else ' (DIFFERS)'}")
    if "pair_block_gemms_us" in r:
        paths += f" | pair-block gemms:{r['pair_block_gemms_us']:.1f}"
        paths += f" | op sorted / pair blocks:{r['op_pair_blocks_false_us']:.1f} / {r['op_pair_blocks_true_us']:.1f}"
    share = {k: f" ({100 * r[f'{k}_of_copy']:.0f}%)" if f"{k}_of_copy" in r else ""
             for k in ("sum_torch", "sum_triton")}
    tiles = " ".join(f"{k}:{v:.1f}" for k, v in r.get("sum_triton_tiles_us", {}).items())
    print(f"{r['model']} {r['M']} {r['pairs']} | {r['align_us']:.1f} {r['casts_us']:.1f} |"
          f" {r['gate_up_us']:.1f} {r['down_us']:.1f} {r['gemms_us']:.1f} |"
          f" {r['sum_torch_us']:.1f}{share['sum_torch']} {r['sum_triton_us']:.1f}{share['sum_triton']} |"
          f" {r['op_us']:.1f} {r['op_torch_sum_us']:.1f} {r['op_triton_sum_us']:.1f} | {r['unexplained_us']:+.1f} |"
          f" {tiles} | {paths}", flush=True)
