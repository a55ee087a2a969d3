"""Which batch sizes get captured target graphs for a given tree size (the rest run eagerly)."""

from __future__ import annotations

from specdec.engine.cuda_graphs import BATCH_LADDER, MAX_GRAPH_TOKENS, ladder_for


def test_ladder_keeps_every_size_for_decode_and_caps_big_trees():
    assert ladder_for(BATCH_LADDER, 1) == BATCH_LADDER  # plain decode: every size up to 128
    big = ladder_for(BATCH_LADDER, 65)  # 64-token trees: a 128 x 65 capture overflowed flashinfer's workspace
    assert big[-1] * 65 <= MAX_GRAPH_TOKENS < (BATCH_LADDER[len(big)]) * 65
    assert ladder_for(BATCH_LADDER, 10_000) == (1,)  # always at least batch 1
