"""`Request.token_ids`: any window of prompt + output, without building the whole sequence for a decode step."""

from hypothesis import given
from hypothesis import strategies as st

from rimuru import SamplingParams
from rimuru.request import Request


@given(st.lists(st.integers(0, 99), min_size=1, max_size=12), st.lists(st.integers(0, 99), max_size=12),
       st.integers(0, 24), st.integers(0, 24), st.integers(0, 2))  # fmt: skip
def test_token_ids_is_a_window_of_prompt_and_output(prompt, output, start, end, pending):
    """Pending tokens (sampled, not yet on the host: async scheduling) read as 0 and count in `num_tokens`."""
    request = Request("r", prompt, SamplingParams(), max_tokens=64, output_token_ids=list(output),
                      num_pending_tokens=pending)  # fmt: skip
    assert request.token_ids(start, end) == (prompt + output + [0] * pending)[start:end]
    assert request.num_tokens == len(prompt) + len(output) + pending
