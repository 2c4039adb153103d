"""`ModelRunner`: turns a `ScheduledBatch` into the model's `ForwardContext`, runs the forward pass, returns logits.

Builds every per-step tensor on the host with a few vectorised gathers from the KV cache's page tables
(no per-layer Python loops), then moves them to the device in one go.
"""

import torch

from rimuru.expert_manager import ExpertManager
from rimuru.kv_cache import KVCacheManager
from rimuru.models import ForwardContext, QwenMoeForCausalLM
from rimuru.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: QwenMoeForCausalLM, kv_cache: KVCacheManager, kv_view: torch.Tensor,
                 experts: ExpertManager):  # fmt: skip
        self.model, self.kv_cache, self.kv_view, self.experts = model, kv_cache, kv_view, experts
        self.device = kv_view.device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Logits [B', V] (fp32) for the requests that finish their known tokens this round, and their batch rows."""
        input_ids, ctx, sample_rows = self.prepare(batch)
        logits = self.model(input_ids, ctx)  # [B', V]
        return logits.float(), sample_rows

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardContext, list[int]]:
        tokens, positions, slots, starts, seq_lens, sample_rows, logits_indices = [], [], [], [0], [], [], []
        for row, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = request.num_computed_tokens
            tokens += request.token_ids(start, start + num_new)
            positions += range(start, start + num_new)
            slots.append(self.kv_cache.slot(request.request_id))
            starts.append(starts[-1] + num_new)
            seq_lens.append(start + num_new)
            if start + num_new == request.num_tokens:  # every known token computed: sample the next one
                sample_rows.append(row)
                logits_indices.append(starts[-1] - 1)
        positions_t = torch.tensor(positions, dtype=torch.int64)  # [T]
        slots_t = torch.tensor(slots, dtype=torch.int64)  # [B]
        counts = torch.tensor(batch.num_new_tokens, dtype=torch.int64)  # [B]
        token_slots = torch.repeat_interleave(slots_t, counts)  # [T]
        page_tokens = self.kv_cache.page_tokens
        tables = self.kv_cache.tables  # [L, slots, P]
        pages = tables[:, token_slots, positions_t // page_tokens].long()  # [L, T]
        slot_mappings = pages * page_tokens + positions_t % page_tokens  # [L, T]
        max_pages = -(-max(seq_lens) // page_tokens)
        kv_page_tables = tables[:, slots_t, :max_pages]  # [L, B, P']
        dev, active = self.device, self.experts.is_active
        ctx = ForwardContext(
            positions=positions_t.to(dev, non_blocking=True),
            query_start_loc=torch.tensor(starts, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            kv_page_tables=kv_page_tables.to(dev, non_blocking=True),
            slot_mappings=slot_mappings.to(dev, non_blocking=True),
            # with every expert resident the kernels read the resident tables and no hook runs
            expert_page_tables=self.experts.working_tables if active else self.experts.store.page_tables,
            kv_view=self.kv_view,
            expert_view=self.experts.store.expert_view,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64).to(dev, non_blocking=True),
            on_routing=self.experts.on_routing if active else self.experts.counting_hook,
        )
        return torch.tensor(tokens, dtype=torch.int64).to(dev, non_blocking=True), ctx, sample_rows
