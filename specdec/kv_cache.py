"""Paged KV cache: a pool of fixed-size pages, K/V tensors addressed by slot, and per-request page tables.

A slot is `page * page_size + offset`. A request's token at position p lives in slot
`pages[p // page_size] * page_size + p % page_size`, so positions are contiguous per request and any page-table
attention kernel (torch gather or flashinfer) can read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import DuplicateRequest, InvalidInput, OutOfPages, UnknownRequest
from specdec.host_copy import to_device


class PagePool:
    """Free list of page ids. After any sequence of requests, `num_free == num_total` again."""

    def __init__(self, num_pages: int):
        self.num_total = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"KV pool full: need {n} pages, {len(self._free)} of {self.num_total} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass
class PageTable:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose K/V slots are reserved (committed + temporary)
    reserved_pages: int = 0  # admission budget: the most pages this request may ever hold
    # slot of every position the first `slot_pages` pages hold, brought up to date when slots are asked for (a
    # resize is list work only: a verify of 128 chains grows and shrinks every request, and the captured paths
    # read page lists, not slots)
    slot_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # [>= slot_pages * size]
    slot_pages: int = 0


class PagedKVCache:
    """K/V storage for all layers of one model plus the page tables of its requests."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ):
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        num_slots = num_pages * page_size
        # [num_layers, num_slots, num_kv_heads, head_dim]
        self.k = torch.zeros(num_layers, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.tables: dict[str, PageTable] = {}
        # Admission is by reservation: a request is admitted only if its worst case fits beside everyone
        # else's, so pages are allocated lazily yet a running request never meets a full pool.
        self.reserved = 0
        self.aside: list[int] = []  # pages taken out of service for good (CUDA-graph padding rows)

    # ---- request lifetime -------------------------------------------------------------------------------
    def add(self, rid: str, max_tokens: int = 0, pool_name: str = "KV pool", fixed: int | None = None) -> None:
        """Start a request that may grow to `max_tokens` tokens; OutOfPages if that cannot be promised now,
        InvalidInput if it never could (more than the whole pool: waiting for pages would only run out the queue
        wait, then blame a full pool that was empty, QA). `fixed`: `check_could_hold`'s."""
        if rid in self.tables:
            raise DuplicateRequest(f"request {rid!r} already holds KV pages")
        self.check_could_hold(max_tokens, pool_name, fixed)
        pages = self.pages_for(max_tokens)
        if self.reserved + pages > self.num_total_pages:
            raise OutOfPages(f"{pool_name} full: request needs {pages} pages, "
                             f"{self.num_total_pages - self.reserved} unreserved")
        self.reserved += pages
        self.tables[rid] = PageTable(reserved_pages=pages)

    def pages_for(self, max_tokens: int) -> int:
        return -(-max_tokens // self.page_size)

    def could_ever_hold(self, max_tokens: int) -> bool:
        """Would a request of `max_tokens` fit in this pool were it empty of requests?"""
        return self.pages_for(max_tokens) <= self.num_total_pages - len(self.aside)

    def check_could_hold(self, max_tokens: int, pool_name: str = "KV pool", fixed: int | None = None) -> None:
        """InvalidInput unless `could_ever_hold`: no wait for pages would admit the request. `fixed`: the slots that
        do not depend on max_new_tokens (the prompt and one draft tree), so the message says what to change: a
        1030-token prompt in a 1024-token pool was told to ask for fewer new tokens (QA)."""
        if self.could_ever_hold(max_tokens):
            return
        holds = self.num_total_pages - len(self.aside)
        head = (f"{pool_name} too small for this request: it needs {self.pages_for(max_tokens)} pages of "
                f"{self.page_size} tokens ({max_tokens} token slots: its prompt, max_new_tokens and one draft tree), "
                f"the whole pool holds {holds}")
        if fixed is None:
            raise InvalidInput(f"{head}; ask for fewer new tokens or send a shorter prompt")
        room = holds * self.page_size - fixed
        if room < 1:
            raise InvalidInput(f"{head}; the prompt and one draft tree alone take {fixed} slots: send a shorter "
                               "prompt")
        raise InvalidInput(f"{head}; ask for at most {room} new tokens")

    def release(self, rid: str) -> None:
        table = self.tables.pop(rid, None)
        if table is None:
            raise UnknownRequest(f"unknown request id {rid!r}")
        self.reserved -= table.reserved_pages
        self.pool.free(table.pages)

    def set_aside(self, num_pages: int) -> list[int]:
        """Allocate pages that never serve a request (padding rows of captured graphs write there)."""
        pages = self.pool.alloc(num_pages)
        self.aside += pages
        self.reserved += num_pages
        return pages

    @property
    def reserved_by_requests(self) -> int:
        return self.reserved - len(self.aside)

    def table(self, rid: str) -> PageTable:
        try:
            return self.tables[rid]
        except KeyError:
            raise UnknownRequest(f"unknown request id {rid!r}") from None

    def length(self, rid: str) -> int:
        return self.table(rid).length

    def resize(self, rid: str, new_len: int) -> None:
        """Grow (allocating pages) or shrink (freeing whole pages past the end) a request to `new_len` tokens."""
        table = self.table(rid)
        ps = self.page_size
        need_pages = -(-new_len // ps)
        if need_pages > len(table.pages):
            table.pages.extend(self.pool.alloc(need_pages - len(table.pages)))
        elif need_pages < len(table.pages):
            self.pool.free(table.pages[need_pages:])
            del table.pages[need_pages:]
            table.slot_pages = min(table.slot_pages, need_pages)  # the pages after it may come back different
        table.length = new_len

    def _slot_ids(self, table: PageTable) -> torch.Tensor:
        """The slot of every position the request's pages hold. # [pages * page_size] int64"""
        ps, have, pages = self.page_size, table.slot_pages, table.pages
        if have < len(pages) or table.slot_ids.shape[0] != len(pages) * ps:
            new = (torch.tensor(pages[have:], dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)
            table.slot_ids = torch.cat([table.slot_ids[: have * ps], new])
            table.slot_pages = len(pages)
        return table.slot_ids

    # ---- addressing ---------------------------------------------------------------------------------------
    def slots(self, rid: str, start: int, end: int) -> torch.Tensor:
        """Slot ids of positions [start, end) of a request. # [end - start] int64 on the CPU (attention
        backends move what they need to the device once per forward)"""
        slot_ids = self._slot_ids(self.table(rid))
        if not 0 <= start <= end <= slot_ids.shape[0]:
            raise IndexError(f"positions [{start}, {end}) of {rid!r} outside its {slot_ids.shape[0]} slots")
        return slot_ids[start:end]

    def move(self, rid: str, src_positions: list[int], dst_start: int) -> None:
        """Copy K/V of `src_positions` (ascending, each >= its destination) to positions dst_start, dst_start+1..

        Used after verification: the accepted tree nodes move down to sit right after the committed prefix.
        """
        if not src_positions or src_positions[-1] == dst_start + len(src_positions) - 1:  # ascending, each >= its
            return  # destination: all in place (a chain's accepted path, every verify)
        keep = [(s, dst_start + i) for i, s in enumerate(src_positions) if s != dst_start + i]
        slot_ids = self._slot_ids(self.table(rid))
        src = to_device(slot_ids[torch.tensor([s for s, _ in keep])], self.k.device)
        dst = to_device(slot_ids[torch.tensor([d for _, d in keep])], self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    # ---- accounting ---------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_total_pages(self) -> int:
        return self.pool.num_total

    @property
    def num_unreserved_pages(self) -> int:
        """Pages no admitted request has reserved: what admission can still give (`add`). A full pool is this near
        0, not `num_free_pages` (pages not yet written): QA saw 8319 free of 8320 with ~126 reserved by one request."""
        return self.num_total_pages - self.reserved

    def gauges(self) -> tuple[int, int, int]:
        """(used, free, unreserved) pages, read by the metrics scrape (plain counters only: another thread)."""
        free = self.num_free_pages
        return self.num_total_pages - free, free, self.num_unreserved_pages

    def stats(self) -> tuple[int, int, int]:
        """(page_size, pages_total, pages_free) as reported to operators: set-aside pages are not counted."""
        return self.page_size, self.num_total_pages - len(self.aside), self.num_free_pages
