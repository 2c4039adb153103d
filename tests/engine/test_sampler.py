"""The batched sampler against its one-row definition: the same filtered distributions, the same log-probabilities,
draws that land on each row's own distribution, and seeded rows drawn exactly as on their own."""

import random
from types import SimpleNamespace

import pytest
import torch

from rimuru.sampler import Sampler, filtered_probs, filtered_row, logprobs_of
from rimuru.sampling_params import SamplingParams

VOCAB = 37


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([0, 0, 2, 5, VOCAB + 4]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.1]),
    )


def tied_logits(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Logits on a coarse grid: many exact ties, at the top-k and top-p boundaries too."""
    return torch.randint(-8, 8, (rows, VOCAB), generator=generator).float() / 2


@pytest.mark.parametrize("seed", range(40))
def test_filtered_probs_of_a_batch_are_each_rows_own(seed):
    """Mixed parameters in one batch (top-k, min-p and top-p on some rows only): each row's distribution equals
    `filtered_row` of that row alone, with the same tokens kept."""
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = rng.randint(1, 6)
    logits, params = tied_logits(rows, generator), [random_params(rng) for _ in range(rows)]
    batched = filtered_probs(logits, params)
    for row in range(rows):
        alone = filtered_row(logits[row], params[row])
        assert torch.equal(batched[row] > 0, alone > 0), f"row {row}: {params[row]}"
        torch.testing.assert_close(batched[row], alone, rtol=1e-6, atol=1e-7)


def test_a_batch_draws_each_row_from_its_own_distribution():
    """Unseeded rows are drawn together: a row whose top_p keeps one token always gets that token (a different one
    for each row, so a row mix-up shows), and a row of two tokens at 0.75 / 0.25 gets them at that rate."""
    logits = torch.full((4, VOCAB), -20.0)
    for row, token in enumerate((3, 11, 29)):
        logits[row, token] = 5.0
    logits[3, 7], logits[3, 8] = torch.tensor(0.75).log(), torch.tensor(0.25).log()
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 3 + [SamplingParams(temperature=1.0)]
    requests = [SimpleNamespace(params=p, generator=None) for p in params]
    sampler, counts = Sampler(torch.Generator().manual_seed(0)), {7: 0, 8: 0}
    for _ in range(2000):
        tokens, _ = sampler(logits, requests)
        assert tokens[:3] == [3, 11, 29]
        counts[tokens[3]] += 1
    assert abs(counts[7] / 2000 - 0.75) < 0.04


def test_a_seeded_row_draws_as_it_would_alone():
    """A seeded request's token is `filtered_row` drawn from its own generator, whatever the other rows are."""
    rng, generator = random.Random(1), torch.Generator().manual_seed(1)
    logits = tied_logits(5, generator) + torch.randn(5, VOCAB, generator=generator)
    params = [random_params(rng) for _ in range(5)]
    requests = [SimpleNamespace(params=p, generator=None) for p in params]
    requests[2] = SimpleNamespace(params=params[2], generator=torch.Generator().manual_seed(9))
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(logits, requests)
    expected = torch.multinomial(filtered_row(logits[2], params[2]), 1, generator=torch.Generator().manual_seed(9))
    assert tokens[2] == int(expected)


def test_logprobs_of_the_asking_rows_are_their_log_softmax():
    """Rows asking 0, 2 and 5 top log-probabilities and one not asking, in one pass: the chosen token first, then
    the row's own top ones, values of that row's log-softmax."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    asks = [2, None, 0, 5]
    requests = [SimpleNamespace(params=SimpleNamespace(logprobs=k)) for k in asks]
    tokens = [4, 9, 30, 0]
    result = logprobs_of(logits, requests, tokens)
    assert result[1] is None
    for row, k in enumerate(asks):
        if k is None:
            continue
        logprobs = logits[row].log_softmax(-1)
        top = logprobs.topk(k) if k else None
        expected = {tokens[row]: float(logprobs[tokens[row]])}
        if top is not None:
            expected |= dict(zip(top.indices.tolist(), top.values.tolist()))
        assert list(result[row]) == list(expected)
        assert result[row] == pytest.approx(expected, abs=1e-6)


def test_the_sampler_benchmark_runs_both_versions(capsys, monkeypatch):
    """`tools/engine/sampler.py` against a second copy of this sampler: both time their steps and count operations,
    the batched one a few dozen whatever the rows."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    from tools.engine import sampler as bench_sampler

    monkeypatch.setattr(sys, "argv", ["bench_sampler.py", "--rows", "6", "--vocab", "64", "--steps", "2",
                                      "--device", "cpu", "--against", str(root / "rimuru" / "sampler.py")])  # fmt: skip
    bench_sampler.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["this"]["ms_median"] > 0 and result["this"]["aten_ops"] == result["against"]["aten_ops"] < 200
