"""A KV cache's occupancy as the services report it (`KVStats` in GetModelInfo: the target's and the draft's)."""

from __future__ import annotations

from specdec.kv_cache import PagedKVCache
from specdec.v1 import common_pb2


def kv_stats(kv: PagedKVCache) -> common_pb2.KVStats:
    page_size, total, free = kv.stats()
    return common_pb2.KVStats(page_size=page_size, pages_total=total, pages_free=free,
                              pages_unreserved=kv.num_unreserved_pages)
