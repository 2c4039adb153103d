"""`rimuru::gated_delta_step`, `rimuru::gated_delta_chunk`, `rimuru::causal_conv1d_step`, `rimuru::causal_conv1d_chunk`:
a hybrid model's linear-attention layers over their state pages, each state updated in place in its page.

The references in `rimuru.ops.reference` are the kernels on every device for now; a GPU kernel that updates the
pages without gathering them registers for "cuda" here.
"""

import torch

from rimuru.ops import reference


@torch.library.custom_op("rimuru::gated_delta_step", mutates_args=("ssm_view",))
def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ssm_view: torch.Tensor, state_ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return reference.gated_delta_step(q, k, v, g, beta, ssm_view, state_ids)


@gated_delta_step.register_fake
def _gated_delta_step_fake(q, k, v, g, beta, ssm_view, state_ids):
    return torch.empty_like(v)


@torch.library.custom_op("rimuru::gated_delta_chunk", mutates_args=("ssm_view",))
def gated_delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm_view: torch.Tensor, state_id: int, continues: bool) -> torch.Tensor:  # fmt: skip
    return reference.gated_delta_chunk(q, k, v, g, beta, ssm_view, state_id, continues)


@gated_delta_chunk.register_fake
def _gated_delta_chunk_fake(q, k, v, g, beta, ssm_view, state_id, continues):
    return torch.empty_like(v)


@torch.library.custom_op("rimuru::causal_conv1d_step", mutates_args=("conv_view",))
def causal_conv1d_step(x: torch.Tensor, conv_view: torch.Tensor, state_ids: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    return reference.causal_conv1d_step(x, conv_view, state_ids, weight, bias)


@causal_conv1d_step.register_fake
def _causal_conv1d_step_fake(x, conv_view, state_ids, weight, bias):
    return torch.empty_like(x)


@torch.library.custom_op("rimuru::causal_conv1d_chunk", mutates_args=("conv_view",))
def causal_conv1d_chunk(x: torch.Tensor, conv_view: torch.Tensor, state_id: int, continues: bool,
                        weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    return reference.causal_conv1d_chunk(x, conv_view, state_id, continues, weight, bias)


@causal_conv1d_chunk.register_fake
def _causal_conv1d_chunk_fake(x, conv_view, state_id, continues, weight, bias):
    return torch.empty_like(x)
