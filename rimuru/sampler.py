"""`Sampler`: the next token of each request from its logits, with a greedy fast path.

Greedy rows take the argmax. Other rows apply temperature, top-k, top-p and min-p, then draw from the request's
own generator when it has a seed (so a seed reproduces whatever else is in the batch), else from the engine's.
Log-probabilities are those of the model's distribution before any of these filters, as in vLLM.
"""

import torch

from rimuru.request import Request


class Sampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[dict[int, float] | None]]:
        """Token ids and (where asked) {token: logprob} for each row of `logits` [B, V] (fp32)."""
        greedy = [r.params.is_greedy for r in requests]
        tokens = logits.argmax(dim=-1)  # [B]
        if not all(greedy):
            tokens = tokens.clone()
            for row, request in enumerate(requests):
                if not greedy[row]:
                    tokens[row] = self._sample_row(logits[row], request)
        token_list = tokens.tolist()
        logprobs = [None if r.params.logprobs is None else self._logprobs(logits[row], r, token_list[row])
                    for row, r in enumerate(requests)]  # fmt: skip
        return token_list, logprobs

    def _sample_row(self, logits: torch.Tensor, request: Request) -> torch.Tensor:  # logits [V]
        params = request.params
        logits = logits / params.temperature
        if params.top_k > 0:
            kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)  # [V]
        if params.min_p > 0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        if params.top_p < 1:
            probs = _top_p(probs, params.top_p)
        generator = request.generator or self.generator
        return torch.multinomial(probs, 1, generator=generator)[0]

    @staticmethod
    def _logprobs(logits: torch.Tensor, request: Request, token: int) -> dict[int, float]:
        logprobs = logits.log_softmax(dim=-1)  # [V]
        top = torch.topk(logprobs, request.params.logprobs) if request.params.logprobs else None
        chosen = {token: float(logprobs[token])}
        if top is not None:
            chosen |= dict(zip(top.indices.tolist(), top.values.tolist()))
        return chosen


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always stays)."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before > top_p * sorted_probs.sum(), 0.0)
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)
