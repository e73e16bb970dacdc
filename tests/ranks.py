"""The end of a rank that a test spawns (torch.multiprocessing.spawn, gloo on loopback)."""
from __future__ import annotations

import os
import sys

import torch.distributed as dist


def leave() -> None:
    """End a spawned rank once it has saved what its test checks, without tearing torch down.

    torch's gloo backend can be left holding the last reference to the process group on one of its own
    worker threads (a finished hook's future callbacks, released when that thread gets the GIL), and its
    destructor then joins that very thread: "Resource deadlock avoided", SIGABRT, the rank fails after doing
    its work. Reproduced here with faulthandler, 1 run in 120 of the one-group PowerSGD test under load, the
    main thread in its atexit handlers. So the caller's frame keeps its DDP model and comm state (and through
    them the group) alive until os._exit ends the process; the barrier first lets every rank finish its
    collectives, so that none leaves while a peer still reads from it.
    """
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
