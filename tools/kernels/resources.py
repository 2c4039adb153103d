"""Registers, spills and shared memory of the sort's Triton kernels, compiled for a GPU this machine need not have.

    python -m tools.kernels.resources [--arch 90] [--experts 60 128] [--tiles 64 128]

Triton's CUDA backend compiles to a cubin without a device (its wheel carries ptxas), and cuobjdump reads the
resource use back: a kernel whose tiles outgrow the registers shows it here before a GPU session spends minutes on
it. At 8 warps an SM's 64K registers hold two programs up to 128 registers a thread, one up to 256; a STACK or
LOCAL above 0 means spills. Times need the GPU (`tools/kernels/bench.py --breakdown`).
"""

import argparse
import os
import re
import subprocess
import tempfile

import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rimuru.ops import moe_align

IDS, I32 = "*i64", "*i32"
SORT_KERNELS = {  # kernel -> (its non-constexpr arguments' types, its constexprs given experts E and a tile T)
    "_count_kernel": ([IDS, I32, I32] + ["i32"] * 4, lambda e, t: {"EXPERTS_PAD": e, "TILE": t}),
    "_scatter_kernel": ([IDS] + [I32] * 4 + ["i32"] * 6,
                        lambda e, t: {"BLOCK_M": 128, "EXPERTS_PAD": e, "TILE": t, "PREFIX_ROWS": max(1, 4096 // e)}),
    "_scatter_scanned_kernel": ([IDS] + [I32] * 4 + ["i32"] * 6, lambda e, t: {"BLOCK_M": 128, "EXPERTS_PAD": e,
                                                                               "TILE": t}),
    "_scan_kernel": ([I32, I32, "i32"], lambda e, t: {  # the most rows the op loads: MAX_SORT_PROGRAMS chunks
        "BLOCK_M": 128, "EXPERTS_PAD": e, "SCAN_ROWS": moe_align.scan_rows(moe_align.MAX_SORT_PROGRAMS, e)}),
}


def resources(kernel, types: list[str], constexprs: dict, arch: int, num_warps: int = 8) -> dict[str, int]:
    """{"REG", "STACK", "SHARED", "LOCAL"} of `kernel` compiled for sm_`arch` (cuobjdump -res-usage)."""
    names = kernel.arg_names
    signature = {name: types.pop(0) if name not in constexprs else "constexpr" for name in names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 and H200)")
    parser.add_argument("--experts", type=int, nargs="*", default=[60, 128])
    parser.add_argument("--tiles", type=int, nargs="*", default=[64, 128])
    args = parser.parse_args()
    for experts in args.experts:
        experts_pad = triton.next_power_of_2(experts)
        for tile in args.tiles:
            for name, (types, constexprs) in SORT_KERNELS.items():
                chosen = {**constexprs(experts_pad, tile), "USE_PDL": False}  # the grid waits take no registers
                used = resources(getattr(moe_align, name), list(types), chosen, args.arch)
                print(f"E={experts} tile={tile} {name}: " + " ".join(f"{k}:{v}" for k, v in used.items()), flush=True)


if __name__ == "__main__":
    main()
