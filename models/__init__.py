"""Rimuru's Qwen MoE models on paged ops, their configuration, checkpoint loading and the test-checkpoint fabricator.

Depends only on `rimuru.ops` and `rimuru.models.context`; never on the scheduler, engine or serving.
"""

from rimuru.models.checkpoint import ExpertWeights
from rimuru.models.config import ModelConfig
from rimuru.models.context import ForwardContext
from rimuru.models.fabricate import fabricate
from rimuru.models.loader import LoadedModel, from_pretrained
from rimuru.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, QwenMoeForCausalLM, model_class

__all__ = [
    "ExpertWeights",
    "ForwardContext",
    "LoadedModel",
    "ModelConfig",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "QwenMoeForCausalLM",
    "fabricate",
    "from_pretrained",
    "model_class",
]
