"""The three-tier page allocator over the pool (docs/architecture.md, The page pool). Bookkeeping only: it never
touches bytes.

    huge page h  (H bytes)        split into expert pages or into SSM pages, never straight into small pages
    ├── expert page p  (P_expert)  holds one expert matrix, or is split into KV pages or into conv pages
    │   ├── kv page k = p * n + i  (i < n = P_expert // kv stride)
    │   └── ...
    └── ssm page s  (P_ssm)

Page ids are offsets in units of their kind's stride, so every id indexes its `MemoryPool` view directly.
Allocation splits downward on demand (free small page -> split a free expert page -> split a free huge page);
freeing merges upward the moment every child is free. Requests get their small pages from the expert page they
last carved from where possible, so their pages free together and the parent merges. Free small pages whose parent
still has a used child are *trapped*: usable for KV, not for experts. `allocate_*` return None when they cannot
be met, so the scheduler can react; misuse (double free, foreign page) raises and changes nothing.
"""

import heapq
from collections.abc import Hashable, Iterable

from rimuru.memory.sizes import PageSizes

EXPERT, SSM, KV, CONV = "expert", "ssm", "kv", "conv"
MIDDLE_KINDS, SMALL_KINDS = (EXPERT, SSM), (KV, CONV)
PAGES_PER_EXPERT = 3  # gate, up, down

Owner = Hashable  # a request id, a (layer, expert) pair, a buffer name


class _Split:
    """An expert page cut into small pages of one kind."""

    __slots__ = ("kind", "free", "num_used")

    def __init__(self, kind: str, first: int, count: int):
        self.kind = kind
        self.free = list(range(first + count - 1, first - 1, -1))  # pop() from the end gives the lowest id
        self.num_used = 0


class _FreeMiddle:
    """Free middle pages of one kind inside split huge pages: lowest id first, O(log n), lazy removal on merge."""

    def __init__(self):
        self.heap: list[int] = []
        self.ids: set[int] = set()

    def push(self, page_id: int) -> None:
        self.ids.add(page_id)
        heapq.heappush(self.heap, page_id)

    def pop(self) -> int | None:
        while self.heap:
            page_id = heapq.heappop(self.heap)
            if page_id in self.ids:
                self.ids.remove(page_id)
                return page_id
        return None

    def __len__(self) -> int:
        return len(self.ids)


class PageAllocator:
    def __init__(self, sizes: PageSizes, pool_bytes: int):
        self.sizes = sizes
        self.pool_bytes = pool_bytes
        self.num_huge_pages = pool_bytes // sizes.huge_page_bytes
        self.payload = {EXPERT: sizes.expert_page_bytes, SSM: sizes.ssm_page_bytes,
                        KV: sizes.kv_page_bytes, CONV: sizes.conv_page_bytes}  # fmt: skip
        self.stride = {EXPERT: sizes.expert_page_bytes, SSM: sizes.ssm_page_stride,
                       KV: sizes.kv_page_stride, CONV: sizes.conv_page_stride}  # fmt: skip
        self.children = {k: sizes.huge_page_bytes // self.stride[k] if self.stride[k] else 0 for k in MIDDLE_KINDS}
        self.children |= {k: sizes.expert_page_bytes // self.stride[k] if self.stride[k] else 0 for k in SMALL_KINDS}
        self._free_huge = list(range(self.num_huge_pages))  # a heap: lowest address first
        self._huge_split: dict[int, list] = {}  # huge id -> [middle kind, children not free]
        self._free_middle = {k: _FreeMiddle() for k in MIDDLE_KINDS}
        self._splits: dict[int, _Split] = {}  # expert page id -> its small pages
        # parents split now, by the kind of their children: what `stats` reads the padding from without a walk
        self._num_split = dict.fromkeys(MIDDLE_KINDS + SMALL_KINDS, 0)
        self._partial = {k: {} for k in SMALL_KINDS}  # ordered sets of split pages with a free small page
        self._num_free_small = dict.fromkeys(SMALL_KINDS, 0)
        self._num_used = dict.fromkeys(MIDDLE_KINDS + SMALL_KINDS, 0)
        self._owned: dict[Owner, dict[str, list[int]]] = {}  # the only record of who holds a used page
        self._home: dict[tuple[Owner, str], int] = {}  # (owner, small kind) -> expert page last carved from

    # ---- queries (no mutation) ---------------------------------------------------------------------------------

    @property
    def num_free_expert_pages(self) -> int:
        """Expert pages obtainable without evicting anything: free expert pages + free huge pages' worth."""
        return len(self._free_middle[EXPERT]) + len(self._free_huge) * self.children[EXPERT]

    def num_free_small_pages(self, kind: str = KV) -> int:
        """Small pages of `kind` obtainable now, free ones already split off plus those in free expert pages."""
        return self._num_free_small[kind] + self.num_free_expert_pages * self.children[kind]

    def num_used_pages(self, kind: str = KV) -> int:
        return self._num_used[kind]

    def can_allocate(self, num_pages: int, kind: str = KV) -> bool:
        if kind in SMALL_KINDS:
            return num_pages <= self.num_free_small_pages(kind)
        return num_pages <= len(self._free_middle[kind]) + len(self._free_huge) * self.children[kind]

    def expert_pages_for(self, num_small_pages: int, kind: str = KV) -> int:
        """The number of expert pages that hold `num_small_pages` (a KV shortfall in expert pages), rounded up."""
        return -(-max(0, num_small_pages) // self.children[kind])

    def pages_of(self, owner: Owner, kind: str) -> list[int]:
        """The pages `owner` holds of `kind`, in allocation order (a copy)."""
        return list(self._owned.get(owner, {}).get(kind, ()))

    def owns(self, owner: Owner) -> bool:
        return owner in self._owned

    def holder(self, page_id: int, kind: str) -> Owner | None:
        """Who holds a used page (a scan: for checks and debugging, not the hot path)."""
        return next((o for o, by_kind in self._owned.items() if page_id in by_kind.get(kind, ())), None)

    # ---- allocation --------------------------------------------------------------------------------------------

    def allocate(self, owner: Owner, num_pages: int, kind: str = KV) -> list[int] | None:
        """`num_pages` pages of `kind` for `owner`, or None (and no change) when they cannot all be had."""
        if num_pages <= 0:
            return [] if num_pages == 0 else None
        if not self.can_allocate(num_pages, kind):
            return None
        if kind in SMALL_KINDS:
            page_ids = self._take_small(owner, num_pages, kind)
        else:
            page_ids = [self._take_middle(kind) for _ in range(num_pages)]
        self._record(owner, kind, page_ids)
        return page_ids

    def allocate_expert(self, owner: Owner) -> list[int] | None:
        """Three expert pages (gate, up, down) for one expert, or None."""
        return self.allocate(owner, PAGES_PER_EXPERT, EXPERT)

    def _take_middle(self, kind: str) -> int:
        page_id = self._free_middle[kind].pop()
        if page_id is None:
            huge_id = heapq.heappop(self._free_huge)
            self._huge_split[huge_id] = [kind, 0]
            self._num_split[kind] += 1
            first = huge_id * self.children[kind]
            for child in range(first, first + self.children[kind]):
                self._free_middle[kind].push(child)
            page_id = self._free_middle[kind].pop()
        self._huge_split[page_id // self.children[kind]][1] += 1
        return page_id

    def _take_small(self, owner: Owner, num_pages: int, kind: str) -> list[int]:
        taken: list[int] = []
        home = self._home.get((owner, kind))
        if home is not None:
            self._carve(home, kind, num_pages, taken)
        partial = self._partial[kind]
        while len(taken) < num_pages and partial:
            home = next(iter(partial))
            self._carve(home, kind, num_pages - len(taken), taken)
        while len(taken) < num_pages:
            home = self._take_middle(EXPERT)
            self._splits[home] = _Split(kind, home * self.children[kind], self.children[kind])
            self._num_split[kind] += 1
            self._num_free_small[kind] += self.children[kind]
            self._carve(home, kind, num_pages - len(taken), taken)
        self._home[(owner, kind)] = home
        return taken

    def _carve(self, parent: int, kind: str, want: int, taken: list[int]) -> None:
        split = self._splits.get(parent)
        if split is None or split.kind != kind or not split.free:
            return
        count = min(want, len(split.free))
        got = split.free[-count:]
        del split.free[-count:]
        got.reverse()
        taken.extend(got)
        split.num_used += count
        self._num_free_small[kind] -= count
        if split.free:
            self._partial[kind][parent] = None
        else:
            self._partial[kind].pop(parent, None)

    def _record(self, owner: Owner, kind: str, page_ids: list[int]) -> None:
        self._owned.setdefault(owner, {}).setdefault(kind, []).extend(page_ids)
        self._num_used[kind] += len(page_ids)

    # ---- freeing -----------------------------------------------------------------------------------------------

    def free(self, owner: Owner) -> None:
        """Free every page `owner` holds; KeyError (and no change) for an owner holding nothing."""
        if owner not in self._owned:
            raise KeyError(f"{owner!r} holds no pages")
        for kind, page_ids in self._owned.pop(owner).items():
            self._release(kind, page_ids)
            self._home.pop((owner, kind), None)

    def free_pages(self, owner: Owner, page_ids: Iterable[int], kind: str = KV) -> None:
        """Free some of `owner`'s pages of `kind`. ValueError (and no change) if any is not `owner`'s."""
        page_ids = list(page_ids)
        held = self._owned.get(owner, {}).get(kind, [])
        drop = set(page_ids)
        bad = drop.difference(held)
        if bad or len(drop) != len(page_ids):
            raise ValueError(f"{kind} pages {sorted(bad) or page_ids} are not held by {owner!r} (or listed twice)")
        held[:] = [p for p in held if p not in drop]
        if not held:
            del self._owned[owner][kind]
            self._home.pop((owner, kind), None)
            if not self._owned[owner]:
                del self._owned[owner]
        self._release(kind, page_ids)

    def _release(self, kind: str, page_ids: list[int]) -> None:
        self._num_used[kind] -= len(page_ids)
        if kind in SMALL_KINDS:
            self._release_small(kind, page_ids)
        else:
            for page_id in page_ids:
                self._release_middle(kind, page_id)

    def _release_small(self, kind: str, page_ids: list[int]) -> None:
        per_parent, splits = self.children[kind], self._splits
        touched: dict[int, _Split] = {}
        for page_id in page_ids:  # the hot loop of a finishing request: kept flat
            parent = page_id // per_parent
            split = touched[parent] = splits[parent]
            split.free.append(page_id)
            split.num_used -= 1
        self._num_free_small[kind] += len(page_ids)
        partial = self._partial[kind]
        for parent, split in touched.items():
            if split.num_used:  # NOTE: merge exactly when the last child is free, not one earlier
                partial[parent] = None
                continue
            self._num_free_small[kind] -= len(split.free)
            del splits[parent]
            self._num_split[kind] -= 1
            partial.pop(parent, None)
            self._release_middle(EXPERT, parent)

    def _release_middle(self, kind: str, page_id: int) -> None:
        huge_id = page_id // self.children[kind]
        entry = self._huge_split[huge_id]
        entry[1] -= 1
        self._free_middle[kind].push(page_id)
        if entry[1]:
            return
        first = huge_id * self.children[kind]
        self._free_middle[kind].ids.difference_update(range(first, first + self.children[kind]))
        del self._huge_split[huge_id]
        self._num_split[kind] -= 1
        heapq.heappush(self._free_huge, huge_id)

    # ---- accounting --------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Bytes and pages by state; free + used + trapped + padding == pool_bytes (pool_bytes as given)."""
        used = {k: self._num_used[k] * self.payload[k] for k in self._num_used}
        trapped = sum(self._num_free_small[k] * self.payload[k] for k in SMALL_KINDS)
        free = len(self._free_huge) * self.sizes.huge_page_bytes
        free += sum(len(self._free_middle[k]) * self.payload[k] for k in MIDDLE_KINDS)
        padding = self.pool_bytes - self.num_huge_pages * self.sizes.huge_page_bytes
        for kind, count in self._num_split.items():  # counted, not walked: read every step by metrics and benches
            parent_bytes = self.sizes.huge_page_bytes if kind in MIDDLE_KINDS else self.sizes.expert_page_bytes
            padding += count * (parent_bytes - self.children[kind] * self.payload[kind])
        return {
            "pool_bytes": self.pool_bytes,
            "free_bytes": free,
            "used_bytes": sum(used.values()),
            "trapped_bytes": trapped,
            "padding_bytes": padding,
            **{f"{k}_used_bytes": v for k, v in used.items()},
            **{f"{k}_used_pages": n for k, n in self._num_used.items()},
            **{f"{k}_trapped_pages": self._num_free_small[k] for k in SMALL_KINDS},
            "free_huge_pages": len(self._free_huge),
            "free_expert_pages": self.num_free_expert_pages,
        }

    def check_integrity(self) -> None:
        """Recount everything from the page trees and assert every invariant of docs/architecture.md, The page pool."""
        from rimuru.memory.integrity import check_allocator

        check_allocator(self)

