"""A resident `ForwardContext` built by hand: every expert in a page of an expert view, fixed KV pages per request.

What the engine's `ModelRunner` does for real, reduced to the minimum a model test needs. Page ids are shuffled on
purpose so that a model reading the wrong page (or assuming contiguous pages) fails.

    kv page of (layer l, request r, i-th page) = kv_perm[(l * max_requests + r) * max_pages + i]
    expert page of (layer l, expert e, matrix m) = expert_perm[(l * E + e) * 3 + m]   (m: 0 gate, 1 up, 2 down)
"""

from collections.abc import Callable

import torch
import transformers

from rimuru.models import ForwardContext, LoadedModel


class ResidentRunner:
    """Runs steps of a few requests through a loaded model, keeping their K/V in a paged view between steps."""

    def __init__(
        self,
        loaded: LoadedModel,
        max_requests: int = 4,
        max_pages: int = 16,
        page_tokens: int = 4,
        on_routing: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
        records_routing: bool = True,
    ):
        """`records_routing=False`: the passes get no routing hook, as the engine's with every expert resident and
        nothing counting."""
        cfg = loaded.config
        self.device = next(loaded.model.parameters()).device
        self.on_routing, self.records_routing = on_routing, records_routing
        self.loaded, self.page_tokens = loaded, page_tokens
        self.max_requests, self.max_pages = max_requests, max_pages
        self.num_layers = len(cfg.attention_layer_ids)  # KV tables: one row an attention layer
        gen = torch.Generator().manual_seed(1234)
        num_kv_pages = self.num_layers * max_requests * max_pages
        self.kv_perm = torch.randperm(num_kv_pages, generator=gen)
        dtype = next(loaded.model.parameters()).dtype
        kv_shape = (num_kv_pages, 2, page_tokens, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_view = torch.full(kv_shape, float("nan"), dtype=dtype, device=self.device)
        self.expert_view, self.expert_page_tables = build_expert_pool(loaded, gen)
        self._build_state_pages(cfg, dtype, gen)
        self.seq_lens = [0] * max_requests
        self.routing_calls: list[tuple[int, tuple, tuple]] = []

    def _build_state_pages(self, cfg, dtype: torch.dtype, gen: torch.Generator) -> None:
        """A hybrid model's SSM and conv pages: one of each per (linear layer, request), shuffled, NaN until written."""
        linear = len(cfg.linear_layer_ids)
        self.ssm_view = self.conv_view = self.ssm_ids = self.conv_ids = None
        if not linear:
            return
        num_pages = linear * self.max_requests
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        channels = 2 * cfg.linear_num_key_heads * dk + hv * dv
        self.ssm_view = torch.full((num_pages + 1, hv, dk, dv), float("nan"), dtype=torch.float32, device=self.device)
        self.conv_view = torch.full((num_pages + 1, channels, cfg.linear_conv_kernel_dim - 1), float("nan"),
                                    dtype=dtype, device=self.device)  # fmt: skip
        self.ssm_ids = torch.randperm(num_pages, generator=gen).view(linear, self.max_requests)
        self.conv_ids = torch.randperm(num_pages, generator=gen).view(linear, self.max_requests)

    def kv_page(self, layer_idx: int, request: int, i: int) -> int:
        return int(self.kv_perm[(layer_idx * self.max_requests + request) * self.max_pages + i])

    def slot(self, layer_idx: int, request: int, pos: int) -> int:
        """page_id * page_tokens + offset of token `pos` of a request in one layer."""
        return self.kv_page(layer_idx, request, pos // self.page_tokens) * self.page_tokens + pos % self.page_tokens

    def step(self, chunks: dict[int, list[int]], all_logits: bool = False, model: Callable | None = None):  # [B', V]
        """Append each request's new tokens ({request: tokens}); logits of every token, or of each chunk's last.
        `model` runs the pass (the loaded model's forward, or a compiled one)."""
        input_ids = torch.tensor([t for toks in chunks.values() for t in toks], dtype=torch.long, device=self.device)
        ctx = self.context(chunks, all_logits)
        for request, toks in chunks.items():
            self.seq_lens[request] += len(toks)
        with torch.no_grad():
            return (self.loaded.model if model is None else model)(input_ids, ctx)

    def context(self, chunks: dict[int, list[int]], all_logits: bool) -> ForwardContext:
        positions, slots, starts, seq_lens = [], [], [0], []
        for request, toks in chunks.items():
            cached = self.seq_lens[request]
            positions += range(cached, cached + len(toks))
            slots.append([(request, pos) for pos in range(cached, cached + len(toks))])
            starts.append(starts[-1] + len(toks))
            seq_lens.append(cached + len(toks))
        requests = list(chunks)
        layers = range(self.num_layers)
        tables = torch.tensor(
            [[[self.kv_page(layer, r, i) for i in range(self.max_pages)] for r in requests] for layer in layers],
            dtype=torch.int32,
        )  # [L, B, max pages]
        flat = [s for per_request in slots for s in per_request]
        mappings = torch.tensor(
            [[self.slot(layer, r, pos) for r, pos in flat] for layer in layers], dtype=torch.int64
        )  # [L, T]
        ends = torch.tensor(starts[1:]) - 1
        dev = self.device
        return ForwardContext(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            kv_page_tables=tables.to(dev),
            slot_mappings=mappings.to(dev),
            expert_page_tables=self.expert_page_tables,
            kv_view=self.kv_view,
            expert_view=self.expert_view,
            logits_indices=(torch.arange(len(positions)) if all_logits else ends).to(dev),
            on_routing=self.record_routing if self.records_routing else None,
            **self._state_fields(chunks),
        )

    def _state_fields(self, chunks: dict[int, list[int]]) -> dict:
        """A hybrid model's state pages of the step's requests; `decode_only` decided on the host, as the runner does."""
        if self.ssm_view is None:
            return {}
        dev, requests = self.device, list(chunks)
        continues = [self.seq_lens[r] > 0 for r in requests]
        return dict(ssm_view=self.ssm_view, conv_view=self.conv_view, ssm_state_ids=self.ssm_ids[:, requests].to(dev),
                    conv_state_ids=self.conv_ids[:, requests].to(dev),
                    state_continues=torch.tensor(continues, device=dev),
                    decode_only=all(continues) and all(len(toks) == 1 for toks in chunks.values()))  # fmt: skip

    def record_routing(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
        self.routing_calls.append((layer_idx, tuple(hidden.shape), tuple(topk_ids.shape)))
        if self.on_routing is not None:
            self.on_routing(layer_idx, hidden, topk_ids)


def build_expert_pool(loaded: LoadedModel, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert view [P, F * D] holding every expert's three matrices, and page tables [L, E, 3] (-1 on dense layers)."""
    cfg = loaded.config
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    num_pages = cfg.num_hidden_layers * e * 3
    perm = torch.randperm(num_pages, generator=gen)
    param = next(loaded.model.parameters())
    view = torch.full((num_pages, f * d), float("nan"), dtype=param.dtype, device=param.device)
    tables = torch.full((cfg.num_hidden_layers, e, 3), -1, dtype=torch.int32, device=param.device)
    for layer_idx, weights in loaded.experts.items():
        for expert_id in range(e):
            for m, matrix in enumerate(weights.matrices(expert_id)):
                page = int(perm[(layer_idx * e + expert_id) * 3 + m])
                view[page] = matrix.reshape(-1)
                tables[layer_idx, expert_id, m] = page
    return view, tables


def load_hf_reference(checkpoint) -> torch.nn.Module:
    """Hugging Face transformers' model of a fabricated checkpoint in fp32, every weight loaded: the reference."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                                    output_loading_info=True)  # fmt: skip
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """The reference's logits [T, V] of one sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0]
