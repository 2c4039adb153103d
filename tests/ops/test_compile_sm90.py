"""The MoE kernels compiled for an H100/H200 (sm_90) on the CPU: Triton's NVIDIA backend and the ptxas its wheel
ships need no GPU, so a kernel that only the GPU compiles (the interpreter runs anything) fails here, in CI, instead
of in a device session. Checks the memory operations that the correctness of the atomic kernels rests on."""

import re
import shutil
from pathlib import Path

import pytest
import triton

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - an older Triton lays these out elsewhere
    GPUTarget = ASTSource = None

from rimuru.ops.moe_align import (
    _align_sorted_program_kernel,
    _atomic_count_kernel,
    _atomic_scatter_kernel,
    _count_kernel,
    _scan_kernel,
    _scatter_kernel,
    _scatter_scanned_kernel,
)
from rimuru.ops.paged_moe import _down_kernel, _gate_up_kernel
from rimuru.ops.topk_sum import _topk_sum_kernel

INT_POINTERS = {"p_page_table", "p_sorted_ids", "p_block_expert", "p_num_padded", "p_counts", "p_cursor",
                "p_chunk_counts", "p_chunk_rows"}


def ptxas_available() -> bool:
    if GPUTarget is None:
        return False
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled.exists() or shutil.which("ptxas") is not None


pytestmark = pytest.mark.skipif(not ptxas_available(), reason="no Triton NVIDIA backend with ptxas here")


def compile_sm90(kernel, constexprs: dict, num_warps: int, tmp_path, monkeypatch, float_type: str = "bf16",
                 **options):  # fmt: skip
    """PTX of `kernel` for sm_90 with these constexprs (pointers typed by name, float ones `float_type`, other
    arguments i32)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a fresh compile, not a cached one
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "p_ids":
            signature[name] = "*i64"
        elif name == "p_weights":
            signature[name] = "*fp32"
        elif name.startswith("p_"):
            signature[name] = "*i32" if name in INT_POINTERS else f"*{float_type}"
        else:
            signature[name] = "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})
    assert compiled.asm["cubin"]
    return compiled.asm["ptx"]


def memory_ops(ptx: str) -> set[str]:
    return {m.group(0) for m in re.finditer(r"\b(?:atom|red)\.[\w.]+", ptx)}


MOE_TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "PAIR_BLOCKS": False, "GROUP_M": 8, "USE_PDL": False,
             "WEIGHT_EVICT": "", "ROW_EVICT": ""}
ATOMIC_COUNT = {"BLOCK_M": 128, "EXPERTS_PAD": 128, "TILE": 256, "BLOCKS_TILE": 32, "USE_PDL": False}
GRID_DEPENDENCY = ("griddepcontrol.launch_dependents", "griddepcontrol.wait")


@pytest.mark.parametrize("read_host", [False, True])
def test_down_kernel_compiles_without_atomics(read_host, tmp_path, monkeypatch):
    """Each output row has one writer: the down kernel stores plainly, no atomics (and, off, no grid waits)."""
    ptx = compile_sm90(_down_kernel, {**MOE_TILES, "READ_HOST": read_host}, 8, tmp_path, monkeypatch, num_stages=3)
    assert memory_ops(ptx) == set() and not any(op in ptx for op in GRID_DEPENDENCY)


@pytest.mark.parametrize("kernel", [_gate_up_kernel, _down_kernel])
def test_fp32_gemms_multiply_in_ieee_fp32_and_bf16_ones_on_tensor_cores(kernel, tmp_path, monkeypatch):
    """`rimuru.ops.exact_dot`: an fp32 model's expert GEMMs take no TF32 products (Triton's default for fp32), a bf16
    model's still run on the tensor cores."""
    tiles = {**MOE_TILES, "READ_HOST": False}
    fp32 = compile_sm90(kernel, tiles, 8, tmp_path, monkeypatch, float_type="fp32", num_stages=3)
    assert "tf32" not in fp32 and "fma.rn.f32" in fp32
    bf16 = compile_sm90(kernel, tiles, 8, tmp_path / "bf16", monkeypatch, num_stages=3)
    assert re.search(r"\b(?:wgmma|mma)\.[\w.]*bf16", bf16)


@pytest.mark.parametrize("kernel", [_gate_up_kernel, _down_kernel])
def test_the_gemms_l2_hints_reach_the_ptx(kernel, tmp_path, monkeypatch):
    """`L2_HINTS`: L2 policies of both kinds (the weights' loads evict first, the token rows' evict last), and the
    output rows' stores carry one; without the key, no policy at all."""
    hints = {**MOE_TILES, "READ_HOST": False, "WEIGHT_EVICT": "evict_first", "ROW_EVICT": "evict_last"}
    ptx = compile_sm90(kernel, hints, 8, tmp_path, monkeypatch, num_stages=3)
    policies = set(re.findall(r"createpolicy\.fractional\.(L2::evict_\w+)", ptx))
    assert policies == {"L2::evict_first", "L2::evict_last"}
    assert re.search(r"ld\.global\.[\w:.]*L2::cache_hint", ptx) and re.search(r"st\.global\.[\w:.]*L2::cache_hint", ptx)
    plain = compile_sm90(kernel, {**MOE_TILES, "READ_HOST": False}, 8, tmp_path / "plain", monkeypatch, num_stages=3)
    assert "createpolicy" not in plain and "cache_hint" not in plain


CHAINED = {  # every kernel of the op, with the constexprs of a Qwen3-sized launch
    "gate_up": (_gate_up_kernel, {**MOE_TILES, "READ_HOST": True}, 8),
    "down": (_down_kernel, {**MOE_TILES, "READ_HOST": False}, 8),
    "sorted_program": (_align_sorted_program_kernel, {"BLOCK_M": 16, "EXPERTS_PAD": 128, "PAIRS_PAD": 128,
                                                      "BLOCKS_TILE": 64}, 4),
    "count": (_count_kernel, {"EXPERTS_PAD": 128, "TILE": 64}, 8),
    "scatter": (_scatter_kernel, {"BLOCK_M": 128, "EXPERTS_PAD": 128, "TILE": 64, "PREFIX_ROWS": 32}, 8),
    "scan": (_scan_kernel, {"BLOCK_M": 128, "EXPERTS_PAD": 128, "SCAN_ROWS": 128}, 8),
    "scatter_scanned": (_scatter_scanned_kernel, {"BLOCK_M": 128, "EXPERTS_PAD": 128, "TILE": 64}, 8),
    "atomic_count": (_atomic_count_kernel, ATOMIC_COUNT, 4),
    "atomic_scatter": (_atomic_scatter_kernel, {"TILE": 256}, 4),
    "topk_sum": (_topk_sum_kernel, {"TOP_K": 8, "BLOCK_D": 1024}, 8),
}


@pytest.mark.parametrize("name", list(CHAINED))
def test_chained_kernels_let_the_next_launch_and_wait_for_the_grid_before_them(name, tmp_path, monkeypatch):
    """With `USE_PDL` every kernel of the op compiles for sm_90 with both grid-dependency instructions
    (`rimuru.ops.dependent_launch`), the wait before its first memory access."""
    kernel, constexprs, num_warps = CHAINED[name]
    ptx = compile_sm90(kernel, {**constexprs, "USE_PDL": True}, num_warps, tmp_path, monkeypatch, num_stages=3)
    assert all(op in ptx for op in GRID_DEPENDENCY)
    first_access = re.search(r"\b(?:ld|st|atom|red)\.global", ptx)
    assert first_access is None or ptx.index("griddepcontrol.wait") < first_access.start()


def test_atomic_sort_kernels_compile_with_their_orderings(tmp_path, monkeypatch):
    """The counts are relaxed reductions, the ticket and the last program's reads of the counts acquire-release;
    the scatter's row claims relaxed atomics."""
    count = compile_sm90(_atomic_count_kernel, ATOMIC_COUNT, 4, tmp_path, monkeypatch)
    assert memory_ops(count) == {"red.global.gpu.relaxed.add.u32", "atom.global.gpu.acq_rel.add.u32"}
    scatter = compile_sm90(_atomic_scatter_kernel, {"TILE": 256, "USE_PDL": False}, 4, tmp_path, monkeypatch)
    assert memory_ops(scatter) == {"atom.global.gpu.relaxed.add.u32"}
