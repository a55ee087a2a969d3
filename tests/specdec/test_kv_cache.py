import random

import pytest
import torch

from specdec.errors import DuplicateRequest, OutOfPages, UnknownRequest
from specdec.kv_cache import PagedKVCache


def _cache(pages=32, page_size=4):
    return PagedKVCache(2, 1, 2, pages, page_size, torch.float32, "cpu")


def test_resize_allocates_and_frees_whole_pages():
    kv = _cache()
    kv.add("a")
    kv.resize("a", 9)
    assert len(kv.table("a").pages) == 3 and kv.num_free_pages == 29
    kv.resize("a", 4)
    assert len(kv.table("a").pages) == 1 and kv.num_free_pages == 31
    kv.release("a")
    assert kv.num_free_pages == 32


def test_slots_follow_page_table():
    kv = _cache(page_size=4)
    kv.add("a")
    kv.add("b")
    kv.resize("a", 4)
    kv.resize("b", 4)
    kv.resize("a", 6)  # a's second page comes after b's first
    pa = kv.table("a").pages
    assert kv.slots("a", 0, 6).tolist() == [pa[0] * 4 + i for i in range(4)] + [pa[1] * 4, pa[1] * 4 + 1]


def test_slots_follow_pages_freed_and_taken_again_between_reads():
    """Slot ids are brought up to date when read: a request that shrinks and grows again without a read in between
    (a verify's tree pages, freed, then the next verify's) gets the slots of the pages it holds now."""
    kv = _cache(page_size=4)
    for rid in ("a", "b"):
        kv.add(rid)
    kv.resize("a", 12)
    assert kv.slots("a", 0, 12).shape[0] == 12
    kv.resize("a", 5)
    kv.resize("b", 8)  # takes the pages a gave back
    kv.resize("a", 16)  # a's third and fourth pages are new ones
    for rid, n in (("a", 16), ("b", 8)):
        pages = kv.table(rid).pages
        assert kv.slots(rid, 0, n).tolist() == [pages[p // 4] * 4 + p % 4 for p in range(n)]
    assert not set(kv.table("a").pages) & set(kv.table("b").pages)


def test_move_compacts_accepted_nodes():
    kv = _cache()
    kv.add("a")
    kv.resize("a", 10)
    slots = kv.slots("a", 0, 10)
    kv.k[:, slots] = torch.arange(10, dtype=torch.float32).view(1, 10, 1, 1).expand(2, 10, 1, 2)
    kv.move("a", [3, 5, 8], 3)  # root stays at 3, nodes at 5 and 8 move to 4 and 5
    assert kv.k[0, kv.slots("a", 3, 6), 0, 0].tolist() == [3.0, 5.0, 8.0]


def test_errors():
    kv = _cache(pages=2)
    kv.add("a")
    with pytest.raises(DuplicateRequest):
        kv.add("a")
    with pytest.raises(OutOfPages):
        kv.resize("a", 100)
    with pytest.raises(UnknownRequest):
        kv.release("nope")


def test_pool_whole_after_randomized_run():
    rng = random.Random(0)
    kv = _cache(pages=64, page_size=4)
    live: dict[str, int] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.3 and len(live) < 10:
            rid = f"r{step}"
            kv.add(rid)
            live[rid] = 0
        elif op < 0.8 and live:
            rid = rng.choice(list(live))
            new = max(0, live[rid] + rng.randint(-6, 8))
            try:
                kv.resize(rid, new)
                live[rid] = new
            except OutOfPages:
                pass
        elif live:
            rid = rng.choice(list(live))
            kv.release(rid)
            del live[rid]
        used = sum(len(kv.table(r).pages) for r in live)
        assert used + kv.num_free_pages == 64
    for rid in list(live):
        kv.release(rid)
    assert kv.num_free_pages == 64
    assert len(set(kv.pool._free)) == 64


def test_unreserved_pages_say_what_admission_can_still_give():
    """A request reserves its worst case at admission and writes pages as it goes: free pages (not written) stay
    high while unreserved ones (what the next request can get) run out. QA: a pool refusing requests showed 8319
    of 8320 pages free; `kv_pages_unreserved` is the gauge that reads 0 then."""
    kv = _cache(pages=32, page_size=4)
    kv.add("a", max_tokens=100)  # 25 pages reserved, none written yet
    kv.resize("a", 3)
    assert (kv.num_free_pages, kv.num_unreserved_pages) == (31, 7)
    assert kv.gauges() == (1, 31, 7)
    with pytest.raises(OutOfPages, match="7 unreserved"):
        kv.add("b", max_tokens=40)
    kv.release("a")
    assert kv.gauges() == (0, 32, 32)
