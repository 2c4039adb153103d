"""`rimuru profile`: measured shares sum to one per layer, and the engine offloads by them."""

import json

import pytest

from rimuru import LLM
from rimuru.expert_ranking import ExpertRanking
from rimuru.serving.cli import main


def test_profile_writes_a_ranking_the_engine_follows(family, tmp_path, capsys):
    folder, prompts, _ = family
    out = tmp_path / "ranking.json"
    assert main(["profile", folder, "--num-prompts", "6", "--max-tokens", "4", "--output", str(out)]) == 0
    layers = json.loads(out.read_text())["layers"]
    assert all(abs(sum(shares) - 1) < 1e-9 for shares in layers.values())
    coldest = {int(k): min(range(len(v)), key=lambda e: (v[e], -e)) for k, v in layers.items()}
    assert len({tuple(v) for v in layers.values()}) > 1  # layers differ: not a uniform placeholder
    engine = LLM(folder, progress=False, expert_policy="fixed", offload_per_layer=1, expert_ranking=str(out)).engine
    assert engine.experts.offloaded == {layer: {expert} for layer, expert in coldest.items()}


def test_a_ranking_for_another_model_is_refused(family, tmp_path):
    folder = family[0]
    path = tmp_path / "wrong.json"
    ExpertRanking({0: (0.5, 0.5)}).save(path)
    with pytest.raises(ValueError, match="the model has MoE layers"):
        LLM(folder, progress=False, expert_ranking=str(path))
