"""After start-up: what exists now (imports, the model's modules, the engines, captured graphs) lives as long as the
process, so it leaves the garbage collector's view (`gc.freeze`). Otherwise every full collection rescans it
(~0.3 M objects: 130-140 ms a collection on a 2-core CPU) and stalls whatever step runs then: in-process on the
H200 one admission of 64 requests in ~8 took 150-200 ms more (0.56-0.62 s against 0.40-0.43; seventeenth pass).
"""

from __future__ import annotations

import gc

# False in a process that starts and stops many services of its own (the test suite, `ServiceThread`s): what one
# freeze takes out of the collector's view stays there, so every service running at a later service's start, once
# stopped, was never freed (its reference cycles: ~1.5 GB a tiny target with its default KV pool; the suite grew past
# 20 GB on a 24 GB machine)
enabled = True


def freeze_start_up_objects() -> None:
    """Collect once, then move every object that survived into the permanent generation (call once start-up is
    done; calling again later freezes what was made since). Nothing when not `enabled`."""
    if not enabled:
        return
    gc.collect()
    gc.freeze()
