"""`GraphInputs`: the static device buffers a captured pass reads, and how one step's rows are written into them.

A CUDA graph reads fixed addresses, so every captured shape (`Shape`) reads slices of these buffers, and a step
writes its rows there, padded to the shape. Padding rows are decodes of token 0 at position 0 with a single K/V
slot in a scratch page that belongs to the graphs, so they write into and read from no request's pages, and they
route like row 0 (`padding_rows`), so they touch no expert a real token does not. A decode shape (one token a
request):

    rows      | 0 .. B-1: the batch                 | B .. size-1: padding         |
    seq_len   | the request's                       | 1                            |
    pages     | its row of the device page tables   | scratch everywhere           |
    slot      | the new token's K/V slot            | scratch * page_tokens        |

A mixed shape (prefill chunks and decodes, T padded tokens): the batch's R requests come first, then the padding
tokens as padding requests of at most one page of tokens each (positions 0, 1, .. in the scratch page), and the
request slots left over hold no token (B = top + ceil(T / page) + 1 slots, never T, so the attention kernels never
take the batch for a decode one):

    tokens    | the batch's T_real tokens, request by request | T_real .. T-1: padding, a page's worth a request |
    requests  | 0 .. R-1: the batch                           | R .. : padding, ceil((T - T_real) / page) | empty  |
    position  | the request's                                 | 0, 1, .. page-1, 0, 1, ..                       |

The pass's first piece gathers the requests' KV page tables and the tokens' slot mappings from the KV cache's
device tables, so a step copies no tables. A hybrid model's decode shapes also read each request's state pages
(`state_views`), its rows of the state tables copied in each step and -1 (no state: the kernels skip the row) for
the padding; its steps with prompt chunks are not captured. Does not own capture or replay (`rimuru.step_graphs`).
"""

from typing import NamedTuple

import torch

from rimuru.models import ForwardContext


class Shape(NamedTuple):
    """What one set of graphs is captured for: padded tokens T, request slots B, sampled rows S."""

    tokens: int
    requests: int
    sampled: int
    mixed: bool  # prefill chunks and decodes (else one token a request, T = B = S)

    @classmethod
    def decode(cls, size: int) -> "Shape":
        return cls(size, size, size, False)

    @classmethod
    def mixed_step(cls, tokens: int, top: int, page_tokens: int) -> "Shape":
        """T tokens: up to `top` requests of the batch, then padding requests of at most a page of tokens each."""
        requests = top + -(-tokens // page_tokens) + 1
        return cls(tokens, requests + (requests == tokens), min(tokens, top), True)  # NOTE: B != T, never decode


class GraphInputs:
    def __init__(self, kv_view: torch.Tensor, kv_tables: torch.Tensor, scratch_page: int, shapes: list[Shape],
                 top: int, state_views: tuple[torch.Tensor, torch.Tensor] | None = None,
                 num_linear_layers: int = 0):  # fmt: skip
        self.kv_tables = kv_tables  # [L, slots, P] the KV cache's page tables on the device, kept up to date by it
        self.scratch_page, self.page_tokens = scratch_page, kv_view.shape[2]
        kv_view[scratch_page].zero_()  # padding tokens read it: finite values from the start
        dev, tokens = kv_view.device, max(s.tokens for s in shapes)
        requests = max(s.requests for s in shapes)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.padding_rows = torch.ones(tokens, dtype=torch.bool, device=dev)
        self.slots = torch.zeros(requests, dtype=torch.int64, device=dev)  # each request's row in `kv_tables`
        self.seq_lens = torch.ones(requests, dtype=torch.int32, device=dev)
        self.padding_requests = torch.ones(requests, dtype=torch.bool, device=dev)
        # decode shapes: token i is request i and is sampled
        self.rows = torch.arange(tokens, dtype=torch.int64, device=dev)
        self.decode_starts = torch.arange(top + 1, dtype=torch.int32, device=dev)  # one token a request
        # mixed shapes: each token's request, where each request's tokens start, the sampled tokens
        self.token_requests = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.mixed_starts = torch.zeros(requests + 1, dtype=torch.int32, device=dev)
        self.sampled_tokens = torch.zeros(top, dtype=torch.int64, device=dev)
        # a hybrid model's state pages: the views, and each request's SSM and conv page a linear layer
        self.state_views = state_views
        self.state_ids = torch.full((2, num_linear_layers, requests), -1, dtype=torch.int64, device=dev)

    @property
    def max_tokens(self) -> int:
        return len(self.input_ids)

    def write(self, inputs, shape: Shape) -> None:
        """A step's rows (`StepInputs`), padded to `shape`: a few small host -> device copies."""
        if shape.mixed:
            self._write_mixed(inputs, shape)
            return
        num_requests = len(inputs.seq_lens)
        self.input_ids[:num_requests].copy_(inputs.input_ids, non_blocking=True)
        inputs.fill_pending(self.input_ids)
        self.positions[:num_requests].copy_(inputs.positions, non_blocking=True)
        self.slots[:num_requests].copy_(inputs.slots, non_blocking=True)
        self.seq_lens[:num_requests].copy_(inputs.seq_lens, non_blocking=True)
        self.padding_rows[:num_requests] = False
        if self.state_views is not None:
            self.state_ids[:, :, :num_requests].copy_(torch.stack(inputs.state_tables), non_blocking=True)
        self._write_padding(num_requests, shape.tokens)

    def write_padding_only(self, shape: Shape) -> None:
        """Every token and request slot of `shape` padding (capture and warm-up)."""
        self._write_padding(0, shape.tokens)
        self.padding_requests[: shape.requests] = True
        self.seq_lens[: shape.requests] = 1
        if shape.mixed:
            positions, token_requests, starts, seq_lens = self._padding_layout(0, shape.tokens, 0, shape.requests)
            self.positions[: shape.tokens] = positions
            self.token_requests[: shape.tokens] = token_requests
            self.mixed_starts[: shape.requests + 1] = torch.cat([torch.zeros(1, dtype=torch.int32), starts])
            self.seq_lens[: shape.requests] = seq_lens
            self.sampled_tokens[: shape.sampled] = 0

    def _padding_layout(self, first_token: int, num_padding: int, first_request: int, num_requests: int):
        """Host tensors for `num_padding` padding tokens from `first_token` on, in requests of at most a page from
        `first_request` on, and empty request slots up to `num_requests`: (positions [P], token requests [P], each
        request's end [num_requests - first_request], seq_lens [num_requests - first_request])."""
        page, index = self.page_tokens, torch.arange(num_padding)
        groups = torch.arange(1, num_requests - first_request + 1)  # [G]
        ends = first_token + (groups * page).clamp(max=num_padding)  # [G] a group's last token + 1
        sizes = (ends - first_token - (groups - 1) * page).clamp(min=1)  # [G] empty slots: 1 (never read)
        return (index % page, first_request + index // page, ends.to(torch.int32), sizes.to(torch.int32))

    def _write_padding(self, start: int, end: int) -> None:
        """Rows [start, end) become padding rows: of a decode shape, tokens and requests."""
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.seq_lens[start:end] = 1
        self.padding_rows[start:end] = True
        self.state_ids[:, :, start:end] = -1

    def _write_mixed(self, inputs, shape: Shape) -> None:
        """A mixed step's layout (module docstring): its tokens and requests, then the padding requests, then empty
        request slots; the sampled tokens, then token 0 for the unused sampled rows."""
        num_tokens, num_requests, num_sampled = len(inputs.input_ids), len(inputs.seq_lens), len(inputs.sample_rows)
        positions, padding_requests, ends, seq_lens = self._padding_layout(num_tokens, shape.tokens - num_tokens,
                                                                           num_requests, shape.requests)  # fmt: skip
        counts = inputs.query_start_loc.diff().long()  # [R] tokens of each request
        token_requests = torch.cat([torch.arange(num_requests).repeat_interleave(counts), padding_requests])  # [T]
        sampled = torch.zeros(shape.sampled, dtype=torch.int64)
        sampled[:num_sampled] = inputs.logits_indices
        self.input_ids[:num_tokens].copy_(inputs.input_ids, non_blocking=True)
        inputs.fill_pending(self.input_ids)
        self.positions[: shape.tokens].copy_(torch.cat([inputs.positions, positions]), non_blocking=True)
        self.slots[:num_requests].copy_(inputs.slots, non_blocking=True)
        self.seq_lens[: shape.requests].copy_(torch.cat([inputs.seq_lens, seq_lens]), non_blocking=True)
        self.mixed_starts[: shape.requests + 1].copy_(torch.cat([inputs.query_start_loc, ends]), non_blocking=True)
        self.token_requests[: shape.tokens].copy_(token_requests, non_blocking=True)
        self.sampled_tokens[: shape.sampled].copy_(sampled, non_blocking=True)
        self.padding_rows[:num_tokens] = False
        self.padding_rows[num_tokens : shape.tokens] = True
        self.input_ids[num_tokens : shape.tokens] = 0
        self.padding_requests[:num_requests] = False
        self.padding_requests[num_requests : shape.requests] = True

    def context(self, shape: Shape, expert_tables: torch.Tensor, kv_view: torch.Tensor, expert_view: torch.Tensor,
                host_experts: dict | None) -> tuple[torch.Tensor, ForwardContext]:  # fmt: skip
        """(input ids [T], the pass's context) over `shape`'s rows; the gathers it starts with run inside the
        pass's first piece (padding requests get the scratch page)."""
        num_tokens, num_requests = shape.tokens, shape.requests
        positions, padding = self.positions[:num_tokens], self.padding_rows[:num_tokens]
        if shape.mixed:
            token_requests, starts = self.token_requests[:num_tokens], self.mixed_starts[: num_requests + 1]
            sampled, padding_requests = self.sampled_tokens[: shape.sampled], self.padding_requests[:num_requests]
        else:  # token i is request i, and every token is sampled
            token_requests, starts = self.rows[:num_tokens], self.decode_starts[: num_requests + 1]
            sampled, padding_requests = self.rows[:num_tokens], padding
        tables = self.kv_tables.index_select(1, self.slots[:num_requests])  # [L, B, P]
        tables = torch.where(padding_requests[None, :, None], self.scratch_page, tables)
        pages = tables[:, token_requests, positions // self.page_tokens].long()  # [L, T]
        ctx = ForwardContext(
            positions=positions,
            query_start_loc=starts,
            seq_lens=self.seq_lens[:num_requests],
            kv_page_tables=tables,
            slot_mappings=pages * self.page_tokens + positions % self.page_tokens,
            expert_page_tables=expert_tables,
            kv_view=kv_view,
            expert_view=expert_view,
            logits_indices=sampled,
            host_experts=host_experts,
            padding_rows=padding,
            **self._state_fields(shape),
        )
        return self.input_ids[:num_tokens], ctx

    def _state_fields(self, shape: Shape) -> dict:
        """A hybrid model's state pages of a decode shape's rows (every request continues its state)."""
        if self.state_views is None:
            return {}
        assert not shape.mixed, "a hybrid model's steps with prompt chunks are not captured"
        ids = self.state_ids[:, :, : shape.requests]
        return dict(ssm_view=self.state_views[0], conv_view=self.state_views[1], ssm_state_ids=ids[0],
                    conv_state_ids=ids[1], state_continues=~self.padding_rows[: shape.requests],
                    decode_only=True)  # fmt: skip
