"""`PendingTokens`: one step's sampled tokens while they are still on their way to the host (async scheduling).

With async scheduling the engine launches step N+1 before it reads step N's tokens: the host schedules and prepares
N+1 while the GPU runs N, so the GPU never waits for the host between steps. N+1's input ids for the requests N
sampled are taken on the device from N's tokens (`device_ids`); N's tokens reach the host through a pinned buffer
that the host reads once the copy's event has passed (`wait`), after N+1 is queued, and so do the logprobs of
the requests that ask for them. A request that N's token finishes (EOS, a stop string) has computed one token too
many in N+1, which the engine drops: the tokens a request gets are the same as without async scheduling.
"""

import torch

from rimuru.request import Request
from rimuru.sampler import logprob_dicts


class PendingTokens:
    def __init__(self, requests: list[Request], tokens: torch.Tensor, logprobs: tuple | None = None):
        """`tokens` [S] int64 on the device, the sampled token of each of `requests`, in order; `logprobs`: the
        asking rows' `rimuru.sampler.logprob_tensors`, on the device too."""
        self.requests, self.tokens = requests, tokens
        self.row_of = {request.request_id: row for row, request in enumerate(requests)}
        self._host = [_to_host(t) for t in (tokens, *(logprobs or ()))]
        self._copied = torch.cuda.Event() if tokens.is_cuda else None
        if self._copied is not None:
            self._copied.record()
        for request in requests:
            request.num_pending_tokens += 1

    def device_ids(self, request_ids: list[str], device: torch.device) -> torch.Tensor:
        """[N] the pending tokens of `request_ids` (each sampled by this step), on the device, for the next step."""
        rows = torch.tensor([self.row_of[request_id] for request_id in request_ids], dtype=torch.int64)
        return self.tokens[rows.to(device, non_blocking=True)]

    def wait(self) -> tuple[list[int], list[dict[int, float] | None]]:
        """(tokens, each request's logprobs or None) on the host, once their copy is done; the requests' pending
        counts taken back."""
        if self._copied is not None:
            self._copied.synchronize()
        for request in self.requests:
            request.num_pending_tokens -= 1
        tokens, *logprobs = (t.tolist() for t in self._host)
        return tokens, logprob_dicts(self.requests, tokens, logprobs or None)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, started now (pinned memory: the copy does not wait for the host)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    return host.copy_(tensor, non_blocking=tensor.is_cuda)
