"""`PageAllocator.check_integrity()`: recount the page trees from scratch and compare with the fast counters.

Kept apart from the allocator because it reads every page (slow by design); tests call it after every step.
Invariants (docs/architecture.md, The page pool): no byte owned twice; free + used + trapped + padding = pool; a
parent is split exactly while one of its children is not free; no small page lies in a huge page not split into
expert pages.
"""

from rimuru.memory.allocator import EXPERT, MIDDLE_KINDS, SMALL_KINDS, PageAllocator


def check_allocator(a: PageAllocator) -> None:
    owner_of = _owner_of(a)
    intervals: list[tuple[int, int, str]] = []  # (start byte, end byte, what)
    _check_huge_pages(a, owner_of, intervals)
    _check_splits(a, owner_of, intervals)
    intervals += [_interval(a, k, p, "used") for k, pages in owner_of.items() for p in pages]
    _check_no_overlap(intervals)
    _check_split_counts(a)
    stats = a.stats()
    total = stats["free_bytes"] + stats["used_bytes"] + stats["trapped_bytes"] + stats["padding_bytes"]
    assert total == a.pool_bytes, f"free + used + trapped + padding = {total} != pool {a.pool_bytes}"
    covered = sum(end - start for start, end, _ in intervals)
    assert covered == total - stats["padding_bytes"], "pages do not cover the non-padding bytes of the pool"


def _check_split_counts(a: PageAllocator) -> None:
    """The split parents counted by their children's kind (what `stats` reads the padding from) match the trees."""
    recount = dict.fromkeys(MIDDLE_KINDS + SMALL_KINDS, 0)
    for kind, _ in a._huge_split.values():
        recount[kind] += 1
    for split in a._splits.values():
        recount[split.kind] += 1
    assert a._num_split == recount, f"split parents counted {a._num_split}, found {recount}"


def _interval(a: PageAllocator, kind: str, page_id: int, what: str) -> tuple[int, int, str]:
    start = page_id * a.stride[kind]
    return start, start + a.payload[kind], f"{what} {kind} page {page_id}"


def _owner_of(a: PageAllocator) -> dict[str, dict]:
    """kind -> page id -> owner, rebuilt from the owners' lists; a page listed twice fails."""
    owner_of: dict[str, dict] = {k: {} for k in MIDDLE_KINDS + SMALL_KINDS}
    for owner, by_kind in a._owned.items():
        for kind, page_ids in by_kind.items():
            assert page_ids, f"{owner!r} has an empty {kind} list"
            for page_id in page_ids:
                assert page_id not in owner_of[kind], f"{kind} page {page_id} held by {owner!r} and another"
                owner_of[kind][page_id] = owner
    for kind, pages in owner_of.items():
        assert len(pages) == a._num_used[kind], f"{kind}: {len(pages)} used, {a._num_used[kind]} counted"
    return owner_of


def _check_huge_pages(a: PageAllocator, owner_of: dict, intervals: list) -> None:
    free_huge = set(a._free_huge)
    assert len(free_huge) == len(a._free_huge), "a huge page is free twice"
    assert not free_huge & a._huge_split.keys(), "a huge page is both free and split"
    assert free_huge | a._huge_split.keys() == set(range(a.num_huge_pages)), "a huge page is lost"
    for huge_id in free_huge:
        start = huge_id * a.sizes.huge_page_bytes
        intervals.append((start, start + a.sizes.huge_page_bytes, f"free huge page {huge_id}"))
    for huge_id, (kind, num_busy) in a._huge_split.items():
        children = range(huge_id * a.children[kind], (huge_id + 1) * a.children[kind])
        free = [c for c in children if c in a._free_middle[kind].ids]
        busy = [c for c in children if c in owner_of[kind] or (kind == EXPERT and c in a._splits)]
        assert len(free) + len(busy) == len(children), f"huge page {huge_id}: a child is neither free nor busy"
        assert num_busy == len(busy) > 0, f"huge page {huge_id}: {num_busy} busy counted, {len(busy)} found"
        intervals.extend(_interval(a, kind, c, "free") for c in free)
    for kind in MIDDLE_KINDS:
        parents = {c // a.children[kind] for c in a._free_middle[kind].ids} if a.children[kind] else set()
        assert all(a._huge_split.get(h, [None])[0] == kind for h in parents), f"free {kind} page in a wrong parent"


def _check_splits(a: PageAllocator, owner_of: dict, intervals: list) -> None:
    for kind in SMALL_KINDS:
        num_free = 0
        for parent, split in a._splits.items():
            if split.kind != kind:
                continue
            assert a._huge_split.get(parent // a.children[EXPERT], [None])[0] == EXPERT, (
                f"{kind} pages in expert page {parent} whose huge page is not split into expert pages"
            )
            assert parent not in owner_of[EXPERT] and parent not in a._free_middle[EXPERT].ids
            children = set(range(parent * a.children[kind], (parent + 1) * a.children[kind]))
            used = {c for c in children if c in owner_of[kind]}
            assert set(split.free) == children - used and len(split.free) == len(children - used)
            assert split.num_used == len(used) > 0, f"expert page {parent} is split but every child is free"
            assert (parent in a._partial[kind]) == bool(split.free), f"partial set wrong for page {parent}"
            num_free += len(split.free)
            intervals.extend(_interval(a, kind, c, "trapped") for c in split.free)
        assert num_free == a._num_free_small[kind], f"{kind}: {num_free} trapped, {a._num_free_small[kind]} counted"
        for page_id in owner_of[kind]:
            assert page_id // a.children[kind] in a._splits, f"used {kind} page {page_id} outside a split"


def _check_no_overlap(intervals: list) -> None:
    intervals.sort()
    for (_, end, what), (start, _, other) in zip(intervals, intervals[1:]):
        assert end <= start, f"{what} overlaps {other}"

