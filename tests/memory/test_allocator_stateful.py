"""Random interleavings of every allocator operation, with every invariant checked after each step."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from rimuru.memory import CONV, EXPERT, KV, SSM, PageAllocator, page_sizes

# Expert page 256 B, SSM page 384 B (huge page = lcm = 768 B: 3 expert or 2 SSM pages), KV 64 B (4 an expert page),
# conv 48 B padded to 64 B. 100 bytes of pool tail padding.
SIZES = page_sizes((64,), (2, 2, 1, 4), torch.float32, ssm_page_shape=(96,), conv_page_shape=(12,))
POOL_BYTES = 6 * 768 + 100


class AllocatorMachine(RuleBasedStateMachine):
    requests = Bundle("requests")
    experts = Bundle("experts")

    @initialize()
    def start(self):
        self.allocator = PageAllocator(SIZES, POOL_BYTES)
        self.held: dict = {}  # owner -> {kind: set of page ids}, the model the allocator must agree with
        self.next_id = 0

    def _new_owner(self, prefix: str) -> str:
        self.next_id += 1
        return f"{prefix}{self.next_id}"

    def _allocate(self, owner, num_pages: int, kind: str):
        possible = self.allocator.can_allocate(num_pages, kind)
        before = self.allocator.stats()
        page_ids = self.allocator.allocate(owner, num_pages, kind)
        if page_ids is None:
            assert not possible and self.allocator.stats() == before
            return None
        assert possible and len(page_ids) == len(set(page_ids)) == num_pages
        self.held.setdefault(owner, {}).setdefault(kind, set()).update(page_ids)
        return owner

    @rule(target=requests, num_pages=st.integers(1, 9), kind=st.sampled_from([KV, KV, CONV]))
    def admit_request(self, num_pages, kind):
        return self._allocate(self._new_owner("req"), num_pages, kind) or self._new_owner("rejected")

    @rule(owner=requests, num_pages=st.integers(1, 5))
    def grow_request(self, owner, num_pages):
        if owner in self.held:
            self._allocate(owner, num_pages, KV)

    @rule(owner=requests)
    def give_request_ssm_state(self, owner):
        if owner in self.held:
            self._allocate(owner, 1, SSM)

    @rule(owner=consumes(requests))
    def finish_request(self, owner):
        if owner in self.held:
            self.allocator.free(owner)
            del self.held[owner]

    @rule(owner=requests, data=st.data())
    def free_some_pages(self, owner, data):
        if owner not in self.held or KV not in self.held[owner]:
            return
        pages = sorted(self.held[owner][KV])
        chosen = data.draw(st.lists(st.sampled_from(pages), min_size=1, max_size=len(pages), unique=True))
        self.allocator.free_pages(owner, chosen, KV)
        self.held[owner][KV] -= set(chosen)
        if not self.held[owner][KV]:
            del self.held[owner][KV]
            if not self.held[owner]:
                del self.held[owner]

    @rule(target=experts)
    def add_expert(self):
        return self._allocate(self._new_owner("expert"), 3, EXPERT) or self._new_owner("rejected")

    @rule(owner=consumes(experts))
    def evict_expert(self, owner):
        if owner in self.held:
            self.allocator.free(owner)
            del self.held[owner]

    @rule(owner=requests, other=requests)
    def bad_frees_change_nothing(self, owner, other):
        before = self.allocator.stats()
        foreign = sorted(self.held.get(other, {}).get(KV, ()))
        if owner != other and foreign:
            with pytest.raises(ValueError):
                self.allocator.free_pages(owner, foreign[:1], KV)
        if owner not in self.held:
            with pytest.raises(KeyError):
                self.allocator.free(owner)
        assert self.allocator.stats() == before

    @invariant()
    def every_invariant_holds(self):
        self.allocator.check_integrity()
        for owner, by_kind in self.held.items():
            for kind, page_ids in by_kind.items():
                assert set(self.allocator.pages_of(owner, kind)) == page_ids

    @invariant()
    def everything_free_means_whole_huge_pages(self):
        if not self.held:
            assert self.allocator.stats()["free_huge_pages"] == self.allocator.num_huge_pages


AllocatorMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
