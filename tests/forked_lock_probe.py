"""Run by the fork server for `tests/test_forkserver.py` as `python -m tests.forked_lock_probe MODE`.

`hold`: take every lock of `SHARED_LOCKS`, say so, and wait to be killed. `take`: take each of them within 5 s
and exit 0, or name the one still taken and exit 1.
"""

from __future__ import annotations

import importlib
import sys
import time

from swarmnode.testing.forkserver import SHARED_LOCKS


def main(mode: str) -> int:
    locks = [(f"{owner}.{name}", getattr(getattr(importlib.import_module(module), owner), name))
             for module, owner, name in SHARED_LOCKS]
    if mode == "hold":
        for _name, lock in locks:
            lock.acquire()
        print("holding every lock", flush=True)
        time.sleep(600)
        return 0
    for name, lock in locks:
        if not lock.acquire(timeout=5):
            print(f"{name} is still taken", flush=True)
            return 1
        lock.release()
    print("took every lock", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
