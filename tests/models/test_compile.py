"""The models' forward pass under `torch.compile` on fabricated checkpoints (CPU, fp32), over the contexts the
resident runner builds as the engine's `ModelRunner` does: a prefill of a few prompts packed, then decode steps.

Without a routing hook (every expert resident, nothing counting) the pass traces as one graph; with one, the hook's
calls are its only graph breaks (`rimuru.models.pieces.call_routing_hook`). Compiled and eager passes give the same
logits and greedy tokens.
"""

import shutil

import pytest
import torch
import torch._dynamo

from rimuru.models import fabricate, from_pretrained
from tests.models.helpers import ResidentRunner

PROMPTS = [[5, 77, 301, 12, 9], [400, 3, 3, 250], [42]]
NUM_DECODES = 2


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def loaded(request, tmp_path_factory):
    arch = request.param
    mlp_only = (1,) if arch == "qwen2_moe" else ()  # a dense layer between MoE ones
    folder = fabricate(tmp_path_factory.mktemp(arch), arch=arch, seed=0, mlp_only_layers=mlp_only)
    return from_pretrained(folder, device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each model compiles from nothing: no cache entries or recompile counts carried over
    yield
    torch._dynamo.reset()


def compile_backend() -> str:
    """inductor where its C++ backend finds a compiler, else aot_eager (the same traced graphs, eager kernels)."""
    return "inductor" if any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")) else "aot_eager"


def greedy_steps(runner: ResidentRunner, model) -> list[torch.Tensor]:
    """Logits [B, V] of a packed prefill of `PROMPTS`, then of `NUM_DECODES` greedy decode steps."""
    logits = [runner.step(dict(enumerate(PROMPTS)), model=model)]
    for _ in range(NUM_DECODES):
        logits.append(runner.step({r: [token] for r, token in enumerate(logits[-1].argmax(-1).tolist())}, model=model))
    return logits


def graph_breaks(explained) -> list[str]:
    """Each break `torch._dynamo.explain` found, as 'file:line reason'."""
    breaks = []
    for reason in explained.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = f"{frame.filename}:{frame.lineno}" if frame is not None else "?"
        breaks.append(f"{where} {reason.reason.splitlines()[0]}")
    return breaks


def explain_prefill_and_decode(runner: ResidentRunner, model) -> list:
    """`torch._dynamo.explain` of a packed prefill of `PROMPTS`, then of a decode step of each (token 7): each pass
    runs once, so the linear layers' state moves as in a step."""
    explain = torch._dynamo.explain(model)
    return [runner.step(dict(enumerate(PROMPTS)), model=explain), runner.step({r: [7] for r in range(len(PROMPTS))},
                                                                              model=explain)]  # fmt: skip


def test_a_pass_without_routing_hook_has_no_graph_break(loaded):
    for step in explain_prefill_and_decode(ResidentRunner(loaded, records_routing=False), loaded.model):
        assert step.graph_break_count == 0 and step.graph_count == 1, graph_breaks(step)


@pytest.mark.parametrize("loaded", ["qwen2_moe", "qwen3_next"], indirect=True)  # the MoE block both families share
def test_the_routing_hooks_are_the_only_graph_breaks(loaded):
    runner = ResidentRunner(loaded)
    for step in explain_prefill_and_decode(runner, loaded.model):
        breaks = graph_breaks(step)
        assert breaks and all("torch.compiler.disable" in b for b in breaks), breaks
    assert {layer for layer, *_ in runner.routing_calls} == set(loaded.config.moe_layer_ids)


@pytest.mark.parametrize("loaded", ["qwen2_moe", "qwen3_moe", "qwen3_next"], indirect=True)
def test_compiled_pass_gives_eager_logits_and_greedy_tokens(loaded):
    compiled = torch.compile(loaded.model, backend=compile_backend(), fullgraph=True, dynamic=True)
    eager = greedy_steps(ResidentRunner(loaded, records_routing=False), None)
    with torch.inference_mode():  # as `ModelRunner.execute` runs the pass
        traced = greedy_steps(ResidentRunner(loaded, records_routing=False), compiled)
    for step_eager, step_traced in zip(eager, traced, strict=True):
        # inductor reorders fp32 reductions, so a logit moves by a few ulps of its magnitude
        torch.testing.assert_close(step_traced, step_eager, rtol=1e-4, atol=1e-4)
        assert torch.equal(step_traced.argmax(-1), step_eager.argmax(-1))
