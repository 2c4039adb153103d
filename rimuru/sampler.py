"""`Sampler`: the next token of each request from its logits, with a greedy fast path.

Greedy rows take the argmax. Other rows apply temperature, top-k, min-p and top-p, then draw. Rows without a seed
are filtered and drawn together from the engine's generator, `CHUNK_ROWS` at a time (`filtered_probs`: a few
tensor operations for a chunk of rows, not a few for each row, docs/benchmarks/engine.md). A seeded row is filtered
and drawn on its own, from its own generator (`filtered_row`), so its tokens never depend on what else is in the
batch. Log-probabilities are those of the model's distribution before any of these filters, as in vLLM, computed
for the rows that ask a chunk at a time.
"""

import torch

from rimuru.request import Request
from rimuru.sampling_params import SamplingParams

# rows filtered (and log-softmaxed) at once: the sort of top-p holds about 7 copies of its rows' logits, so at
# max_num_seqs rows it would be the largest thing a step allocates outside the pool
CHUNK_ROWS = 16


class Sampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[dict[int, float] | None]]:
        """Token ids and (where asked) {token: logprob} for each row of `logits` [B, V] (fp32)."""
        token_list = self.sample(logits, requests).tolist()
        return token_list, logprobs_of(logits, requests, token_list)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """[B] int64 token ids on the logits' device, without waiting for them."""
        tokens = logits.argmax(dim=-1)  # [B]
        unseeded = [row for row, r in enumerate(requests) if not r.params.is_greedy and r.generator is None]
        for chunk in _chunks(unseeded):
            probs = filtered_probs(logits[chunk], [requests[row].params for row in chunk])  # [S, V]
            tokens[chunk] = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        for row, request in enumerate(requests):
            if not request.params.is_greedy and request.generator is not None:
                probs = filtered_row(logits[row], request.params)  # [V]
                tokens[row] = torch.multinomial(probs, 1, generator=request.generator)[0]
        return tokens


def filtered_row(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # logits [V] -> probs [V]
    """One row's sampling distribution: temperature, then top-k, min-p and top-p. The definition `filtered_probs`
    computes for many rows at once."""
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)  # [V]
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1:
        probs = _top_p(probs[None], torch.tensor([params.top_p], device=probs.device))[0]
    return probs


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:  # [S, V] -> [S, V]
    """`filtered_row` of every row at once, each with its own parameters; a filter no row asks for is skipped."""
    device, vocab = logits.device, logits.shape[-1]
    logits = logits / _column([p.temperature for p in params], logits)
    top_ks = [min(p.top_k, vocab) for p in params]
    if any(k > 0 for k in top_ks):
        ranks = torch.tensor([max(k, 1) - 1 for k in top_ks], device=device)[:, None]  # [S, 1]
        kth = logits.topk(max(top_ks), dim=-1).values.gather(1, ranks)  # [S, 1] each row's k-th largest
        limited = torch.tensor([k > 0 for k in top_ks], device=device)[:, None]
        logits = logits.masked_fill((logits < kth) & limited, float("-inf"))
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < _column([p.min_p for p in params], probs) * probs.amax(-1, keepdim=True), 0.0)
    if any(p.top_p < 1 for p in params):
        probs = _top_p(probs, _column([p.top_p for p in params], probs)[:, 0])
    return probs


def _chunks(rows: list[int]) -> list[list[int]]:
    return [rows[i : i + CHUNK_ROWS] for i in range(0, len(rows), CHUNK_ROWS)]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """[S, 1] per-row values in `like`'s dtype and device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:  # probs [S, V], top_p [S]
    """Keep in each row the smallest set of most likely tokens whose mass reaches its top_p (the top token always
    stays; 1 keeps them all). The sort is stable: tied tokens keep their id order."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    limit = top_p[:, None] * sorted_probs.sum(dim=-1, keepdim=True)  # [S, 1]
    sorted_probs = sorted_probs.masked_fill((mass_before > limit) & (top_p[:, None] < 1), 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def logprobs_of(logits: torch.Tensor, requests: list[Request], tokens: list[int]) -> list[dict[int, float] | None]:
    """{chosen token: logprob} plus each asking row's top `logprobs` tokens, None for rows that do not ask."""
    found = logprob_tensors(logits, requests, torch.tensor(tokens, device=logits.device))
    return logprob_dicts(requests, tokens, None if found is None else [t.tolist() for t in found])


def logprob_tensors(logits: torch.Tensor, requests: list[Request], tokens: torch.Tensor) -> tuple | None:
    """On the device, for the rows that ask (None if none does): (chosen logprob [R], top ids [R, k], top values
    [R, k]), k the most any row asks; a log-softmax and a top-k a chunk of rows. `tokens` [B]: each row's token."""
    rows = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return None
    most = max(requests[row].params.logprobs for row in rows)
    chosen, ids, values = [], [], []
    for chunk in _chunks(rows):
        logprobs = logits[chunk].log_softmax(dim=-1)  # [R, V]
        chosen.append(logprobs.gather(1, tokens[chunk][:, None])[:, 0])
        top = logprobs.topk(most, dim=-1)  # k = 0: empty
        ids.append(top.indices)
        values.append(top.values)
    return torch.cat(chosen), torch.cat(ids), torch.cat(values)


def logprob_dicts(requests: list[Request], tokens: list[int], found: list | None) -> list[dict[int, float] | None]:
    """`logprob_tensors`' lists on the host as each row's {chosen token: logprob, then its own top ones}."""
    result: list[dict[int, float] | None] = [None] * len(requests)
    if found is None:
        return result
    chosen, top_ids, top_values = found
    rows = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
    for i, row in enumerate(rows):
        k = requests[row].params.logprobs
        result[row] = {tokens[row]: chosen[i]} | dict(zip(top_ids[i][:k], top_values[i][:k]))
    return result
