"""Rimuru: Mixture-of-Experts serving with expert weights and the KV cache in one elastic pool of GPU pages.

The core: configuration, the page pool, expert store, scheduler, engine, sampling and the offline `LLM` API.
Never imports `rimuru.serving`.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "rimuru.llm",
    "Engine": "rimuru.engine",
    "EngineConfig": "rimuru.config",
    "SamplingParams": "rimuru.sampling_params",
    "RequestOutput": "rimuru.outputs",
    "CompletionOutput": "rimuru.outputs",
}


def __getattr__(name: str):
    """Import the heavy parts (torch, transformers) only when they are asked for."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rimuru' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "__version__"]
