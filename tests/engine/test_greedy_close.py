"""`assert_greedy_close`, the GPU tests' comparison with Hugging Face: it passes equal tokens and refuses a token
Hugging Face's logits did not nearly tie."""

import pytest

from tests.engine.conftest import assert_greedy_close


def test_equal_tokens_pass_and_a_confident_difference_fails(family):
    folder, prompts, expected = family
    assert_greedy_close(folder, prompts, expected, expected)
    changed = [list(t) for t in expected]
    changed[2][1] = (changed[2][1] + 1) % 50  # another token where a random model's best logit leads by far more
    with pytest.raises(AssertionError, match="token 1 of prompt 2"):
        assert_greedy_close(folder, prompts, changed, expected)
