"""One process of the durability tests (see ``test_checkpoint_durability.py``).

``python exit_worker.py <directory> <mode>`` builds the four-table model, saves
step 1 (values ``init + 5``) asynchronously with its writing slowed by a second
(so it is still pending), prints ``pending=<bool>`` and then:

- ``return``: returns from ``main`` without closing the manager (exit code 0);
- ``raise``: lets an exception escape (exit code 1);
- ``exit``: calls ``sys.exit(3)``;
- ``kill``: first saves step 1 synchronously, then starts step 2 whose writing
  never ends, prints ``saving`` and waits to be killed.
"""

from __future__ import annotations

import sys
import time

from test_checkpoint_manager import OPT, bumped, init

from jaxrec import checkpoint as ckpt
from jaxrec.checkpoint import stream


def slowed(seconds: float):
    save_buffer = stream.save_buffer

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return save_buffer(*args, **kwargs)

    return slow


def main(directory: str, mode: str) -> int:
    graphdef, state = init(dropout=False)
    mgr = ckpt.CheckpointManager(directory)
    if mode == "kill":
        mgr.async_save = False
        mgr.save(1, graphdef, OPT, bumped(state, 5))
        mgr.async_save = True
        stream.save_buffer = slowed(3600)
        mgr.save(2, graphdef, OPT, bumped(state, 6))
        print("saving", flush=True)
        time.sleep(3600)
    stream.save_buffer = slowed(1.0)
    mgr.save(1, graphdef, OPT, bumped(state, 5))
    print(f"pending={mgr._thread is not None and mgr._thread.is_alive()}", flush=True)
    if mode == "raise":
        raise RuntimeError("an exception escapes the training loop")
    if mode == "exit":
        sys.exit(3)
    return 0


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
