"""Run `python -m specdec ...` under cProfile (the calling thread: a service's event loop) and write the profile
to OUT when the process ends. A service ends through `specdec.rpc.cli_support.end_process` (`os._exit`, which
skips `python -m cProfile`'s own dump), so the dump is hooked there. `bench/service_process.py` uses this when
SPECDEC_BENCH_PROFILE is set.

    python bench/profiled_service.py OUT serve-target --model models/tiny-code/target ...
"""

from __future__ import annotations

import cProfile
import sys


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    from specdec.rpc import cli_support

    profile = cProfile.Profile()
    end = cli_support.end_process

    def dump_then_end(code: int):
        profile.disable()
        profile.dump_stats(out)
        end(code)

    cli_support.end_process = dump_then_end
    from specdec.cli import main as specdec_main

    sys.argv = ["specdec", *argv]
    profile.enable()
    try:
        code = specdec_main()
    finally:
        profile.disable()
        profile.dump_stats(out)
    sys.exit(code)


if __name__ == "__main__":
    main()
