"""Sampling and stopping: seeds reproduce, top_k=1 is greedy, stop ids and strings end the output where they should."""

import pytest

from rimuru import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(family):
    return LLM(family[0], progress=False)


def tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seed_reproduces_whatever_the_batch(llm, family):
    prompts = family[1]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    alone = tokens(llm, [prompts[2]], params)[0]
    in_batch = tokens(llm, prompts[:5], [SamplingParams(temperature=1.0, max_tokens=10)] * 2 + [params] * 3)
    assert in_batch[2] == alone
    other_seed = tokens(llm, [prompts[2]], SamplingParams(temperature=1.0, seed=8, max_tokens=10, ignore_eos=True))[0]
    assert other_seed != alone


def test_top_k_one_is_greedy(llm, family):
    prompts, expected = family[1], family[2]
    sampled = tokens(llm, prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True, seed=3))
    assert sampled == expected


def test_n_sequences_are_returned_together(llm, family):
    out = llm.generate(family[1][3], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5), use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1


def test_stop_token_id_ends_the_output(llm, family):
    prompt, expected = family[1][4], family[2][4]
    stop_at = next(i for i, t in enumerate(expected) if expected.index(t) == i and i >= 3)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[expected[stop_at]]),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.token_ids == expected[: stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == expected[stop_at]


def test_stop_string_cuts_the_text(llm, family):
    prompt = family[1][5]
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"degenerate text {text!r}"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert full.outputs[0].token_ids[: len(out.token_ids)] == out.token_ids


def test_logprobs_hold_the_chosen_token(llm, family):
    out = llm.generate(family[1][1], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    completion = out.outputs[0]
    for token, logprobs in zip(completion.token_ids, completion.logprobs):
        assert token in logprobs and logprobs[token] == max(logprobs.values()) and len(logprobs) == 3
    assert completion.cumulative_logprob < 0


@pytest.mark.parametrize(
    "field, value, allowed",
    [("temperature", -1, ">= 0"), ("top_p", 0, r"\(0, 1\]"), ("top_k", -2, "positive"), ("min_p", 2, r"\[0, 1\]"),
     ("max_tokens", 0, ">= 1"), ("n", 0, ">= 1"), ("logprobs", 50, r"\[0, 20\]")],
)  # fmt: skip
def test_invalid_sampling_parameter_names_field_and_range(field, value, allowed):
    with pytest.raises(ValueError, match=f"{field} must be .*{allowed}"):
        SamplingParams(**{field: value})


def test_prompt_longer_than_context_names_both_numbers(llm):
    context = llm.engine.config.max_model_len
    with pytest.raises(ValueError, match=f"{context + 5} tokens.*context is {context}"):
        llm.generate([[5] * (context + 5)], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_missing_checkpoint_says_what_was_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        LLM(str(tmp_path / "nope"), progress=False)


def test_a_vanishing_temperature_is_greedy(llm, family):
    prompts, expected = family[1], family[2]
    params = SamplingParams(temperature=1e-300, max_tokens=12, ignore_eos=True)
    assert tokens(llm, prompts[:3], params) == expected[:3]


def test_a_bad_prompt_in_a_batch_queues_nothing(llm, family):
    prompts = family[1]
    with pytest.raises(ValueError, match="context is"):
        llm.generate([prompts[0], [5] * (llm.engine.config.max_model_len + 1)], use_tqdm=False)
    assert not llm.engine.has_unfinished()
