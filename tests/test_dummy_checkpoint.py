"""tools/vs_vllm/checkpoint.py: random weights with a router skew, written as a checkpoint, load back as exactly the
weights the dummy loader drew, so vLLM and Rimuru can serve the same ones."""

import json
import shutil

import torch

from rimuru.models import fabricate, from_pretrained
from tools.vs_vllm.checkpoint import save_checkpoint


def test_a_written_dummy_checkpoint_loads_back_as_the_same_weights(tmp_path):
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    tiny = fabricate(tmp_path / "tiny", arch="qwen2_moe", mlp_only_layers=(1,))
    shutil.copy(f"{tiny}/config.json", config_dir)
    drawn = from_pretrained(config_dir, dtype=torch.float32, load_format="dummy", router_skew=1.0, progress=False)
    shards = save_checkpoint(drawn, str(tmp_path / "out"), shard_bytes=200_000)
    assert len(shards) > 1 and json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    read = from_pretrained(tmp_path / "out", dtype=torch.float32, progress=False)
    ours, theirs = dict(drawn.model.named_parameters()), dict(read.model.named_parameters())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert drawn.experts.keys() == read.experts.keys()
    for layer in drawn.experts:
        assert all(torch.equal(a, b) for a, b in zip(vars(drawn.experts[layer]).values(),
                                                     vars(read.experts[layer]).values()))  # fmt: skip
