"""`PendingTokens`: one step's sampled tokens while they are still on their way to the host (async scheduling).

With async scheduling the engine launches step N+1 before it reads step N's tokens: the host schedules and prepares
N+1 while the GPU runs N, so the GPU never waits for the host between steps. N+1's input ids for the requests N
sampled are taken on the device from N's tokens (`device_ids`); N's tokens reach the host through a pinned buffer
that the host reads once the copy's event has passed (`wait`), after N+1 is queued. A request that N's token
finishes (EOS, a stop string) has computed one token too many in N+1, which the engine drops: the tokens a request
gets are the same as without async scheduling.
"""

import torch

from rimuru.request import Request


class PendingTokens:
    def __init__(self, requests: list[Request], tokens: torch.Tensor):
        """`tokens` [S] int64 on the device, the sampled token of each of `requests`, in order."""
        self.requests, self.tokens = requests, tokens
        self.row_of = {request.request_id: row for row, request in enumerate(requests)}
        pinned = tokens.is_cuda
        self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=pinned)
        self._host.copy_(tokens, non_blocking=pinned)
        self._copied = torch.cuda.Event() if pinned else None
        if self._copied is not None:
            self._copied.record()
        for request in requests:
            request.num_pending_tokens += 1

    def device_ids(self, request_ids: list[str], device: torch.device) -> torch.Tensor:
        """[N] the pending tokens of `request_ids` (each sampled by this step), on the device, for the next step."""
        rows = torch.tensor([self.row_of[request_id] for request_id in request_ids], dtype=torch.int64)
        return self.tokens[rows.to(device, non_blocking=True)]

    def wait(self) -> list[int]:
        """The tokens on the host, once their copy is done; the requests' pending counts taken back."""
        if self._copied is not None:
            self._copied.synchronize()
        for request in self.requests:
            request.num_pending_tokens -= 1
        return self._host.tolist()
