"""Page geometry is chosen, never refused: a KV page that does not fit the expert page gets fewer tokens."""

import pytest
import transformers

from rimuru import LLM
from rimuru.memory import fitting_page_tokens
from rimuru.models import fabricate
from tests.engine.conftest import MAX_TOKENS, hf_greedy, make_prompts
from tests.engine.test_experts import GREEDY


@pytest.mark.parametrize("intermediate, expected", [(32, 16), (16, 16), (12, 8), (4, 4), (3, 2), (1, 1)])
def test_the_largest_page_up_to_the_default_that_the_expert_page_carries(intermediate, expected):
    """K and V of a token: 2 x 2 heads x 16 = 64 elements; the expert page F x 64. F = 12: 768 elements hold 12
    tokens, and halving from 16 gives 8."""
    config = transformers.Qwen2MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         moe_intermediate_size=intermediate)  # fmt: skip
    assert fitting_page_tokens(config, 16) == expected


def test_one_token_that_does_not_fit_is_refused_in_one_line():
    config = transformers.Qwen2MoeConfig(hidden_size=8, num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                                         moe_intermediate_size=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"one token's K and V \(128 elements\) do not fit in an expert page of 8"):
        fitting_page_tokens(config, 16)


def test_a_narrow_expert_page_starts_with_smaller_kv_pages_and_hugging_faces_tokens(tmp_path):
    """The geometry a user met: 16 tokens' K and V (1,024 elements) over an expert page of 768."""
    folder = fabricate(tmp_path, arch="qwen2_moe", config_overrides={"moe_intermediate_size": 12})
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(folder).vocab_size)[:3]
    llm = LLM(folder, progress=False)
    assert llm.engine.config.page_tokens == 8
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(folder, prompts, MAX_TOKENS)
