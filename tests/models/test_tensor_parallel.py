"""Tensor parallelism at the model level (`rimuru.models.parallel`): two CPU processes over gloo, each loading its
shard of a fabricated checkpoint (its heads, its slice of every dense, shared and routed expert's features), give
Hugging Face's logits for a prefill and then decode steps, with routed experts in either checkpoint layout."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rimuru.models import ModelConfig, fabricate, from_pretrained, parallel
from tests.models.helpers import ResidentRunner, hf_logits, load_hf_reference

PROMPTS = [[5, 77, 301, 12, 9], [400, 3, 3, 250, 17, 88, 101], [42]]
SIZE = 2


def _rank(rank: int, checkpoint: str, rendezvous: str, out: str) -> None:
    """One rank: its shard loaded, a prefill and three greedy decode steps; the logits saved where `out` says."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=SIZE)
    try:
        parallel.init(rank, SIZE)
        torch.manual_seed(0)
        runner = ResidentRunner(from_pretrained(checkpoint, device="cpu", dtype=torch.float32, progress=False))
        steps = [runner.step(dict(enumerate(PROMPTS)))]
        for _ in range(3):
            steps.append(runner.step({r: [tok] for r, tok in enumerate(steps[-1].argmax(-1).tolist())}))
        torch.save(steps, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch,layout", [("qwen2_moe", "per_expert"), ("qwen3_moe", "fused"), ("qwen3_next", "fused"),
                                         ("qwen3_5_moe", "per_expert")])  # fmt: skip
def test_two_ranks_give_hugging_faces_logits(tmp_path, arch, layout):
    """The hybrids split their linear-attention heads too (Qwen3.5's composite checkpoint against transformers'
    text model on the same weights)."""
    dense = (1,) if arch == "qwen2_moe" else ()  # a dense MLP layer among the MoE ones
    checkpoint = fabricate(tmp_path / arch, arch=arch, expert_layout=layout, mlp_only_layers=dense)
    reference = checkpoint if arch != "qwen3_5_moe" else fabricate(tmp_path / "text", arch="qwen3_5_moe_text",
                                                                   expert_layout=layout)  # fmt: skip
    out = str(tmp_path / "logits")
    mp.spawn(_rank, args=(checkpoint, str(tmp_path / "rendezvous"), out), nprocs=SIZE, join=True)
    steps = [torch.load(f"{out}.{rank}") for rank in range(SIZE)]
    hf_model, seqs = load_hf_reference(reference), [list(p) for p in PROMPTS]
    for step, logits in enumerate(steps[0]):
        torch.testing.assert_close(steps[1][step], logits, rtol=0, atol=0)  # every rank holds the summed result
        expected = torch.stack([hf_logits(hf_model, s)[-1] for s in seqs])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        for seq, token in zip(seqs, expected.argmax(-1).tolist()):
            seq.append(token)


def test_a_size_that_does_not_divide_the_heads_is_refused_in_one_line(tmp_path):
    config = ModelConfig.from_hf(fabricate(tmp_path, arch="qwen3_moe"))
    with pytest.raises(ValueError, match="^tensor_parallel_size 4 does not divide num_key_value_heads \\(2\\)"):
        config.shard(4)
    assert config.shard(2).num_attention_heads == config.num_attention_heads // 2
    assert config.shard(2).moe_intermediate_size == config.moe_intermediate_size // 2


def test_one_process_is_rank_0_of_1_and_holds_every_weight(tmp_path):
    assert parallel.shard() == parallel.Shard(0, 1)
    checkpoint = fabricate(tmp_path, arch="qwen3_moe")
    loaded = from_pretrained(checkpoint, dtype=torch.float32, progress=False)
    assert loaded.config == ModelConfig.from_hf(checkpoint)
