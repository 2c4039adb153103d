"""`dot`: `tl.dot` in its operands' own precision.

Triton multiplies fp32 operands in TF32 by default (a 10-bit mantissa), so an fp32 model's logits drift from eager
torch's by more than a greedy near tie; fp32 operands take IEEE products here, 16-bit ones Triton's default (the
same instructions as a plain `tl.dot`)."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc=None):
    """`a @ b`, plus `acc` when given."""
    if a.dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out
