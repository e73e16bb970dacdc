"""The run's watcher: a process on the head that judges a detached run while nobody is looking.

`launch` starts it (`python -m cluster.runs.watch RUN_ID`, in a session of its own,
output to runs/<id>/watch.log). It follows the run exactly as a foreground
`launch` does (runstate.follow: poll, judge, stop the survivors of a failure)
and exits when the run reaches a final state with every node confirmed stopped (a node that cannot be
reached is retried as it comes back, for STOP_RETRY_FOR_S). A lock per run keeps it to one
watcher however often it is started; a foreground `launch` and `status` may
judge at the same time, which is safe (records.update, the clock in the record).

NOTE: the engines see a dead peer too (collective timeouts end the survivors'
training processes), but only this process can see a node that went silent as
a whole, stop what the engines left running (a rank blocked outside a
collective, a torchrun agent waiting to restart) and keep the failed node's
last log lines for the morning.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import traceback

from cluster.runs import records, state as runstate
from cluster.errors import ClusterError

INTERVAL_S = 5.0  # between two polls; with the grace, a silent node is judged within ~35-55 s
# After the verdict (or the user's stop), how long the watcher goes on retrying the stop on nodes that
# could not be reached; after that `status` and the next launch's busy check retry them.
STOP_RETRY_FOR_S = 1800.0
# A bug met while following (not a ClusterError) is logged and the run looked at again, this many times in all:
# one surprise must not leave a detached run unjudged until someone runs `status`; a bug that repeats ends it.
MAX_SURPRISES = 10


def spawn(run_id: str) -> int:
    """Start the watcher detached from this process (and its terminal); returns its pid."""
    folder = records.run_path(run_id)
    with open(folder / "watch.log", "ab") as out:
        p = subprocess.Popen(  # bounded: started, never waited for
            [sys.executable, "-m", "cluster.runs.watch", run_id], stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, cwd=folder)
    return p.pid


def watch(run_id: str, interval: float = INTERVAL_S) -> records.RunRecord | None:
    """Follow the run to its end, unless another watcher already does (returns None then)."""
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(records.file_lock(records.run_path(run_id) / ".watch.lock", f"watcher of {run_id}", wait=0))
        except ClusterError:
            return None
        record = records.load(run_id)
        records.update(run_id, lambda r: setattr(r, "watcher", {"pid": os.getpid(), "started": time.time()}))
        surprises = 0
        while True:
            try:
                record = runstate.follow(record, interval=interval, retry_for=STOP_RETRY_FOR_S)
                return record
            except ClusterError as e:  # e.g. a lock held too long: log it, look again
                print(f"{time.strftime('%H:%M:%S')} {e}", flush=True)
            except Exception:  # noqa: BLE001 - the run's only judge while nobody looks: log it, look again
                surprises += 1
                print(f"{time.strftime('%H:%M:%S')} unexpected error ({surprises} of {MAX_SURPRISES}):", flush=True)
                traceback.print_exc()
                if surprises >= MAX_SURPRISES:
                    raise
            time.sleep(interval)
            record = records.load(run_id)
            if not record.active and not record.stop_pending:
                return record


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m cluster.runs.watch RUN_ID", file=sys.stderr)
        return 2
    try:
        record = watch(argv[0])
    except Exception:  # noqa: BLE001 - a watcher has no user to show it to: the log keeps it
        traceback.print_exc()
        return 1
    if record is not None:
        print(f"{time.strftime('%H:%M:%S')} run {record.run_id}: {record.state}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
