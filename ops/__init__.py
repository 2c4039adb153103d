"""Rimuru's ops: kernels over pool pages, each with a torch reference (`rimuru.ops.reference`).

The model code calls only the functions exported here; on CPU they run the references.
"""

from rimuru.ops.reference import paged_attention, paged_moe, write_kv

__all__ = ["paged_attention", "paged_moe", "write_kv"]
