"""`rounded`: an fp32 value rounded to a narrower dtype and back, the way torch rounds each op's result.

Fused kernels keep torch's per-op roundings so that their bf16 outputs equal the unfused torch form's."""

import triton
import triton.language as tl


@triton.jit
def bf16_rounded(x):
    """fp32 x rounded to bf16 (to nearest, ties to even) on its bits: the GPU compiler kept the exact fp32 product
    where a `.to(bf16).to(fp32)` round trip stood, which broke bit equality with the torch form."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """fp32 x as torch leaves an op's result of `dtype`, back in fp32 for the next step."""
    if dtype == tl.bfloat16:
        return bf16_rounded(x)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype).to(tl.float32)
