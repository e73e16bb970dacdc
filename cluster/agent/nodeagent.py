"""Runs on a node with its system Python (stdlib only): start, watch and stop one run's processes.

    nodeagent.py start  RUN_DIR        detach `sh launch.sh` in its own session; print pid/pgid as JSON
    nodeagent.py status RUN_DIR        state, exit code, live processes, last metrics (the built-in programs'
                                       and $CLUSTER_METRICS') and log lines (as a terminal shows them) as JSON
    nodeagent.py stop   RUN_DIR [GRACE [reform]]  SIGTERM the run's processes, SIGKILL what is left after
                                       GRACE; `reform`: the head is restarting the survivors (see restart)
    nodeagent.py restart RUN_DIR PERIOD NOTE   start launch.sh again for membership period PERIOD (the head
                                       uploaded its new files), once nothing of the run runs: the last
                                       period's pid/exit/stop files go to attempts/period-<N>/, NOTE to the log
    nodeagent.py manifest RUN_DIR [checkpoints]   regular files of the run with size and sha256
    nodeagent.py freeport              a TCP port free on this node right now
    nodeagent.py code-missing CACHE_DIR           < manifest: the blobs of a program folder the cache lacks
    nodeagent.py code-tree CACHE_DIR RUN_DIR      < manifest: RUN_DIR/program/ from verified cache blobs
                                       (both in codecache.py, which the head puts beside this file)

A run's processes are found by runprocs.py, its files read by runfiles.py, both shipped beside this file
(cluster/runs/payload.AGENT_FILES). Output is one JSON line.

The run's programs get a TMPDIR of their own (RUN_DIR/.tmp), emptied when each launch
starts and removed when it ends: what a stopped program could not clean up (TensorFlow's
autograph modules, torchrun's torchelastic_* folders, a user's temporary files) does not
pile up in the PC's /tmp run after run.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING or __package__:  # in the package (tests, type checks)
    from cluster.agent.runfiles import (TMP, failure, last_records, manifest, prefix_sha, read_json, screen,
                                        tail_lines, user_metrics)
    from cluster.agent.runprocs import boot_id, run_processes, start_ticks
else:  # on the node: the head ships them beside this file
    from runfiles import (TMP, failure, last_records, manifest, prefix_sha, read_json, screen, tail_lines,
                          user_metrics)
    from runprocs import boot_id, run_processes, start_ticks

if TYPE_CHECKING:  # the node's system Python may be older than the head's: aliases for mypy only
    Doc = dict[str, Any]  # one JSON object: a file of the run folder, or a reply

FIREWALL_CLOSE = "firewall-close.sh"  # runs/firewall.py CLOSE: removes the firewall rules launch opened for the run
LOG = "node.log"
STOP = "stop.json"  # a stop was asked for: the run is stopped, or never starts
ORPHAN_AGENT_S = 360.0  # see _wait_launcher
KILL_SETTLE_S = 5.0  # how long `stop` waits for SIGKILLed processes to be gone before it says what is left


def _write_json(path: Path, data: Doc) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


@contextmanager
def _agent_lock(run_dir: Path, wait: float = 10.0) -> Iterator[int]:
    """start and stop of one run folder, one at a time: a stop either comes before the start (which then
    refuses) or sees everything the start began. Bounded: a start holds it for a fork, never longer.
    The lock is on the folder itself (flock works on a directory's descriptor): no file of ours in the run."""
    fd = os.open(str(run_dir), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield fd
    finally:
        os.close(fd)


def start(run_dir: Path) -> Doc:
    """Fork a session leader that runs launch.sh and records its exit; return at once. A run folder with a
    stop request is never started: the stop may have come while the head was still uploading."""
    with _agent_lock(run_dir) as lock_fd:
        if (run_dir / STOP).exists():
            return {"ok": False, "stop_requested": True,
                    "error": f"{run_dir} has a stop request (clusterctl stop came before the start): not started"}
        if (run_dir / "pid.json").exists():
            return {"ok": False, "error": f"{run_dir} was already started"}
        return _fork_leader(run_dir, lock_fd)


def restart(run_dir: Path, period: int, note: str) -> Doc:
    """Start the run again, for membership period `period`, on this surviving node (cluster/runs/elastic.py).
    Refused while a process of the run is alive, and when the user's stop is recorded (a stop the head sent
    to re-form the run says `reform` and does not count). Asked twice for the same period (a lost reply),
    the second answer is the first start's while it runs; a start of that period that was stopped since (the
    restart was taken over by another process) is started again."""
    with _agent_lock(run_dir) as lock_fd:
        stop_doc = read_json(run_dir / STOP)
        if stop_doc is not None and not stop_doc.get("reform"):
            return {"ok": False, "stop_requested": True,
                    "error": f"{run_dir} has a stop request (clusterctl stop): not restarted"}
        pid_doc = read_json(run_dir / "pid.json") or {}
        left = run_processes(run_dir)
        if pid_doc.get("period", 1) == period and left and not (run_dir / "exit.json").exists():
            return {"ok": True, "already": True, **pid_doc}
        if left:
            return {"ok": False, "left": left, "error": f"{len(left)} process(es) of the run still run: stop first"}
        keep = run_dir / "attempts" / f"period-{pid_doc.get('period', 1)}"
        n = 1
        while keep.exists():  # that period was started before and stopped again (a restart taken over)
            n += 1
            keep = run_dir / "attempts" / f"period-{pid_doc.get('period', 1)}.{n}"
        keep.mkdir(parents=True)
        for name in ("pid.json", "exit.json", STOP):
            if (run_dir / name).exists():
                os.replace(run_dir / name, keep / name)
        with open(run_dir / LOG, "a") as f:
            f.write(f"---- clusterctl: {note} ----\n")
        return _fork_leader(run_dir, lock_fd, period)


def _fork_leader(run_dir: Path, lock_fd: int, period: int = 1) -> Doc:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the session leader: pgid == its pid, outlives the SSH session
        os.close(r)
        os.close(lock_fd)  # the lock is the parent's to release: a copy here would hold it for the whole run
        os.setsid()
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        log = os.open(run_dir / LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        # A handler, not SIG_IGN: `stop` signals the whole group, this process must live on to record
        # the exit, and exec resets handlers (an ignored signal would be inherited by the job).
        signal.signal(signal.SIGTERM, lambda *_: None)
        tmp = run_dir / TMP
        shutil.rmtree(tmp, ignore_errors=True)  # a period before whose leader was killed
        try:
            tmp.mkdir()
            env = {**os.environ, "TMPDIR": str(tmp)}
        except OSError as e:  # the run still starts, with the PC's own TMPDIR
            sys.stderr.write(f"nodeagent: no {tmp} ({e.strerror}): the programs keep the node's TMPDIR\n")
            env = dict(os.environ)
        child = subprocess.Popen(["sh", "launch.sh"], cwd=run_dir, env=env)  # bounded: see the wait below
        doc = {"pgid": os.getpid(), "launcher_pid": child.pid, "started": time.time(), "boot_id": boot_id(),
               "leader_start": start_ticks(os.getpid()), "period": period}
        _write_json(run_dir / "pid.json", doc)
        os.write(w, json.dumps(doc).encode())
        os.close(w)
        code = _wait_launcher(run_dir, child)
        ended = time.time()  # before anything else: a stop asked after it found the run over (status)
        _close_firewall(run_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        _write_json(run_dir / "exit.json", {"code": code, "ended": ended})
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    return {"ok": True, **json.loads(data)}


def _usage_module() -> Any:
    """usage.py (resource sampling), beside this file on the node; None where it is missing."""
    try:
        if TYPE_CHECKING or __package__:  # in the package (tests, type checks)
            from cluster.agent import usage
        else:  # on the node: beside this file
            import usage
    except ImportError:
        return None
    return usage


def _sampler(run_dir: Path) -> Any:
    mod = _usage_module()
    if mod is None or not (run_dir / "out").is_dir():
        return None
    return mod.Sampler(run_dir / "out" / mod.FILE, lambda: run_processes(run_dir))


def sampler_interval() -> float:
    mod = _usage_module()
    return float(os.environ.get("CLUSTERCTL_SAMPLE_S", mod.SAMPLE_S if mod else 5.0))


def _last_usage(run_dir: Path) -> Doc | None:
    """The run's last usage sample (out/usage.jsonl), for `status`."""
    lines = tail_lines(run_dir / "out" / "usage.jsonl", 1)
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _workers(run_dir: Path) -> list[int]:
    """The run's processes that torchrun started as workers (they carry LOCAL_RANK; its agent does not)."""
    out = []
    for p in run_processes(run_dir):
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"LOCAL_RANK=") for e in env):
            out.append(p)
    return out


def _wait_launcher(run_dir: Path, child: subprocess.Popen[bytes]) -> int:
    """launch.sh's exit code. Bounded on the node, head or no head: torchrun's agent can outlive its
    workers, blocked in a call to the rendezvous store of a node it can no longer reach (seen: still there
    10 minutes later). Once the run has had workers and none has lived for ORPHAN_AGENT_S (torchrun's own
    exit barrier, 300 s, and a minute), what is left of the run is stopped here and the run fails."""
    limit = float(os.environ.get("CLUSTERCTL_ORPHAN_AGENT_S", ORPHAN_AGENT_S))
    last_worker: float | None = None
    sampler, every = _sampler(run_dir), sampler_interval()
    sampled = 0.0
    while True:
        if sampler is not None and time.monotonic() - sampled >= every:
            sampled = time.monotonic()
            try:
                sampler.sample()
            except Exception as e:  # noqa: BLE001 - measuring must never end the run it measures
                sys.stderr.write(f"nodeagent: usage sampling stopped: {e}\n")
                sampler = None
        try:
            return child.wait(timeout=min(2.0, every))
        except subprocess.TimeoutExpired:
            pass
        if _workers(run_dir):
            last_worker = time.monotonic()
        elif last_worker is not None and time.monotonic() - last_worker > limit:
            break
    sys.stderr.write(f"nodeagent: the launcher outlived its last worker by {limit:.0f} s "
                     "(torchrun's agent blocked on an unreachable rendezvous store?): stopping it\n")
    sys.stderr.flush()
    left = run_processes(run_dir)
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        for p in left:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and (left := run_processes(run_dir)):
            time.sleep(0.2)
    return child.wait()  # bounded: SIGKILL above


def status(run_dir: Path, lines: int = 20) -> Doc:
    pid_doc = read_json(run_dir / "pid.json")
    alive = run_processes(run_dir)
    # after the processes, not before: the leader writes exit.json and then exits, so once it is gone its
    # record is there. Read first, a leader ending between the two reads looked gone without a record
    # ("vanished"), which failed runs that had succeeded (seen on a 4-node and a 2-node lab)
    exit_doc = read_json(run_dir / "exit.json")
    stopped = _stopped_it(run_dir, exit_doc)
    if pid_doc is None:
        state = "stopped" if stopped else "not started"  # a stop before the start: it never will
    elif alive and exit_doc is None:
        state = "running"
    elif exit_doc is not None and not alive:
        state = "stopped" if stopped else ("succeeded" if exit_doc["code"] == 0 else "failed")
    elif exit_doc is not None:
        state = "stopping"  # the launcher ended, some of its processes did not (yet)
    else:
        state = "stopped" if stopped else "vanished"  # the leader died without recording an exit
    metrics = {}
    for f in sorted((run_dir / "out").glob("metrics-rank*.jsonl")):
        metrics[f.stem.removeprefix("metrics-rank")] = last_records(f)
    return {"state": state, "pid": pid_doc, "exit": exit_doc, "processes": alive, "metrics": metrics,
            "user_metrics": user_metrics(run_dir / "out" / "user-metrics.jsonl"),  # launch.sh's $CLUSTER_METRICS
            "log": screen(tail_lines(run_dir / LOG, lines)), "time": time.time(), "usage": _last_usage(run_dir),
            **(failure(run_dir / LOG) if exit_doc is not None and exit_doc.get("code") else {})}


def _stopped_it(run_dir: Path, exit_doc: Doc | None) -> bool:
    """Did a stop end this run? Not one asked after its launcher had ended by itself: between the launcher's
    end and its exit record (the firewall closed, the record written) a stop still finds no exit record and
    writes its own, and the run that had succeeded was reported stopped. A stop record that cannot be read
    (or has no time) still counts: it is only ever written by a stop."""
    if not (run_dir / STOP).exists():
        return False
    ended, when = (exit_doc or {}).get("ended"), (read_json(run_dir / STOP) or {}).get("time")
    return not (isinstance(ended, (int, float)) and isinstance(when, (int, float)) and ended < when)


def stop(run_dir: Path, grace: float = 10.0, reform: bool = False) -> Doc:
    """`reform`: the head stops this survivor to start it again (restart); the user's stop replaces such a
    request, never the other way round, so a restart after it is refused."""
    with _agent_lock(run_dir):  # after a start in progress, before any later one (which then refuses)
        asked = read_json(run_dir / STOP)
        if asked is None and not (run_dir / "exit.json").exists() or (asked or {}).get("reform") and not reform:
            # the user's stop replacing the head's keeps its time: that stop is the one that ended the run
            first = (asked or {}).get("time")
            _write_json(run_dir / STOP, {"time": first if isinstance(first, (int, float)) else time.time(),
                                         **({"reform": True} if reform else {})})
    sent = run_processes(run_dir)
    for p in sent:
        try:
            os.kill(p, signal.SIGTERM)  # torchrun forwards it to its workers and exits
        except ProcessLookupError:
            pass
    deadline = time.time() + grace
    while time.time() < deadline and run_processes(run_dir):
        time.sleep(0.2)
    killed = run_processes(run_dir)
    for p in killed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # a killed process is gone once the kernel has torn it down: on a loaded PC that takes more than a moment
    deadline = time.time() + KILL_SETTLE_S
    while killed and time.time() < deadline and run_processes(run_dir):
        time.sleep(0.1)
    left = run_processes(run_dir)
    closed = None if left else _close_firewall(run_dir)
    return {"ok": not left, "terminated": sent, "killed": killed, "left": left,
            **({"firewall": closed} if closed is not None else {})}


def _close_firewall(run_dir: Path) -> Doc | None:
    """The run's own firewall rules removed (launch wrote firewall-close.sh where it opened a firewall with
    `become`): when the run ends, and on `stop` (the leader may be killed with the rest). Bounded; None where
    the run opened none, else {"closed": bool, "error": what is still open or why the script failed}."""
    script = run_dir / FIREWALL_CLOSE
    if not script.exists():
        return None
    try:
        r = subprocess.run(["sh", str(script)], cwd=str(run_dir), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return {"closed": False, "error": str(e)[-300:]}
    if r.returncode != 0:
        return {"closed": False, "error": r.stdout.decode("utf-8", "replace").strip()[-300:] or
                "exit code %d" % r.returncode}
    return {"closed": True}


def freeport() -> Doc:
    with socket.socket() as s:
        s.bind(("", 0))
        return {"port": s.getsockname()[1]}


def code_action(argv: list[str]) -> Doc:
    """code-missing, code-tree: a user's program folder (cluster/runs/code.py ships it, with codecache.py)."""
    try:
        if TYPE_CHECKING or __package__:  # in the package (tests, type checks)
            from cluster.agent import codecache
        else:  # on the node: beside this file
            import codecache
    except ImportError as e:
        return {"ok": False, "error": f"codecache.py is missing beside {__file__} ({e}): launch again"}
    return codecache.main(argv[0], argv[1:], sys.stdin.buffer.read())


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("code-missing", "code-tree"):
        result = code_action(argv)
        sys.stdout.write(json.dumps(result) + "\n")
        return 0 if result.get("ok") else 1
    if not argv or argv[0] not in ("start", "restart", "status", "stop", "manifest", "prefix", "freeport"):
        sys.stderr.write(__doc__ or "")
        return 2
    if argv[0] == "freeport":
        result = freeport()
    elif argv[0] == "prefix":  # prefix FILE [LENGTH]: sha256 of the first LENGTH bytes, or of the whole file
        result = prefix_sha(Path(argv[1]), int(argv[2]) if len(argv) > 2 else None)
    else:
        run_dir = Path(argv[1]).resolve()
        if not run_dir.is_dir():
            if argv[0] == "stop":  # not uploaded yet: nothing can be running; the request stays for the start
                try:
                    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                    _write_json(run_dir / STOP, {"time": time.time(), "before_upload": True})
                except OSError as e:
                    sys.stdout.write(json.dumps({"ok": False, "error": f"cannot record the stop in {run_dir}: "
                                                                      f"{e.strerror}"}) + "\n")
                    return 1
                sys.stdout.write(json.dumps({"ok": True, "terminated": [], "killed": [], "left": [],
                                             "note": f"no run folder {run_dir}: the stop is recorded, "
                                                     "it will never start"}) + "\n")
                return 0
            sys.stdout.write(json.dumps({"ok": False, "state": "missing", "error": f"no run folder {run_dir}"}) + "\n")
            return 1
        if argv[0] == "start":
            result = start(run_dir)
        elif argv[0] == "restart":
            result = restart(run_dir, int(argv[2]), argv[3] if len(argv) > 3 else f"period {argv[2]}")
        elif argv[0] == "manifest":
            result = manifest(run_dir, len(argv) > 2 and argv[2] == "checkpoints")
        elif argv[0] == "status":
            result = status(run_dir, int(argv[2]) if len(argv) > 2 else 20)
        else:
            result = stop(run_dir, float(argv[2]) if len(argv) > 2 else 10.0, argv[3:4] == ["reform"])
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
