"""Run `python -m zpd ARGS` under cProfile timed by the main thread's CPU time, not
the wall clock (a profile by wall time charges a socket send with the time the
process waited for a core on a loaded machine, and ZeroMQ's I/O thread is not the
caller's): `python bench/cpu_profile.py OUT zpd-args...`; stats in OUT."""
from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main() -> None:
    out, sys.argv = sys.argv[1], ["zpd", *sys.argv[2:]]
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    try:
        runpy.run_module("zpd", run_name="__main__", alter_sys=True)
    finally:
        prof.disable()
        prof.dump_stats(out)


if __name__ == "__main__":
    main()
