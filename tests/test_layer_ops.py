"""`tools/engine/layer_ops.py`: a decode layer of either family calls rimuru's ops, GEMMs and views, and nothing
else on a GPU (the one other op is the router's cast, which the GPU's fp32-output GEMM does not launch)."""

import pytest
import torch

from tools.engine.layer_ops import OUTSIDE, decode_pass_ops, kind


@pytest.mark.parametrize("arch, rimuru_ops", [("qwen2_moe", 8), ("qwen3_moe", 6)])
def test_a_decode_layer_leaves_inductor_nothing_to_fuse(arch, rimuru_ops):
    ops = decode_pass_ops(arch, torch.bfloat16)
    layers = [scope for scope in ops if scope != OUTSIDE]
    assert len(layers) == 3 and "aten::embedding" in ops[OUTSIDE]
    for scope in layers:
        kinds = [kind(name) for name in ops[scope]]
        assert kinds.count("rimuru op") == rimuru_ops and "rimuru::paged_moe" in ops[scope]
        assert [name for name in ops[scope] if kind(name) == "other"] == ["aten::to"], scope
