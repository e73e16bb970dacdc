"""Run records on the head: $CLUSTERCTL_HOME/runs/<run-id>/run.json (and the rendered files).

A record carries everything needed to find the run again without the inventory
it came from: the job's resolved settings, a snapshot of the hosts, and each
node's run folder and process ids.

Several clusterctl processes touch one record at once (a foreground `launch`,
the run's watcher, `status`, `collect`, a second launch's busy check), so:
every change is a read-modify-write under the run's lock (`update`), every
write goes to a unique temporary file that is fsynced and renamed over the
record, and a reader that cannot parse a record says so instead of skipping it.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from cluster import paths
from cluster.errors import ClusterError, UsageError
from cluster.inventory.model import Host

ACTIVE = ("starting", "queued", "running", "restarting", "stopping")
FINAL = ("succeeded", "failed", "stopped")
# The only moves a run's state makes (RunRecord.move is the one place that changes it): a final state is
# never left, and a stop the user asked for (`stopping`) ends `stopped`, whatever a later step finds, unless
# every node's program had ended by itself with exit 0 before the stop reached it (its agent then says
# `succeeded`: it writes no stop where the program had ended; a run that ends at its target_acc meets a stop
# sent when its last epoch was seen): the run succeeded, the stop found nothing to stop.
MOVES: dict[str, tuple[str, ...]] = {
    "starting": ("queued", "running", "stopping", "failed", "stopped"),
    # accepted by its scheduler, waiting for nodes (Slurm's PENDING, with its reason); a job the scheduler
    # requeued (it lost a node) waits there again
    "queued": ("running", "stopping", "failed", "stopped"),
    "running": ("queued", "restarting", "stopping", "succeeded", "failed", "stopped"),
    # continuing without a lost node (cluster/runs/elastic.py): the survivors are stopped and started again
    "restarting": ("running", "stopping", "failed", "stopped"),
    "stopping": ("stopped", "succeeded"),
}
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z")
# What a run folder on the head holds besides one folder per node (node names must differ from these).
RUN_FOLDER_ENTRIES = frozenset({"run.json", "rendered", "watch.log", "report.html", "report.md"})
LOCK_WAIT_S = 30.0  # the longest a writer waits for another (holders keep locks for milliseconds)


class RecordError(ClusterError):
    """A run record exists but cannot be read (torn, edited by hand, from an incompatible version)."""

    exit_code = 2


@dataclass
class RunNode:
    node: str
    node_rank: int
    nproc: int
    run_dir: str
    pids: dict[str, Any] | None = None


@dataclass
class Failure:
    node: str
    reason: str
    log: list[str] = field(default_factory=list)
    also: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # the global ranks that failed on `node`, where known

    def fix(self, gpus: int | None = None) -> str | None:
        """What to do, where the log says it plainly: a module the nodes' environment lacks, or CUDA asked of a
        node with no GPU (`gpus`: the failed node's, as launch found them)."""
        if gpus == 0 and any(_NO_GPU in line for line in self.log):
            return (f"{self.node} has no NVIDIA GPU (`clusterctl check` lists each node's): run on the CPU there, e.g. "
                    "`device = 'cuda' if torch.cuda.is_available() else 'cpu'` and the gloo backend")
        missing = next((m for line in reversed(self.log) if (m := _NO_MODULE.search(line))), None)
        if missing is None:
            return None
        name = missing.group(1).split(".")[0]
        return (f"{name} is not in the nodes' environment: put its package (pip's name, which may differ) in a "
                "requirements.txt at the top of the program's folder (launch uses it without naming it) or give "
                "`--requirements FILE`; it is installed offline beside the provisioned environment")


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
_NO_GPU = "Found no NVIDIA driver on your system"  # torch's words when a program asks CUDA of a PC without one

@dataclass
class RunRecord:
    """One run, as saved in run.json. Unknown keys of a newer version are kept in `extra` and written back."""

    run_id: str
    job: str
    framework: str
    state: str
    created: float
    nodes: list[RunNode]
    inventory: dict[str, Any]  # {"path", "name", "hosts": [Host.to_dict()]}
    settings: dict[str, Any] = field(default_factory=dict)
    spec_file: str = ""
    world_size: int = 0
    endpoint: str | None = None
    data_file: str = ""
    clusterctl: str = ""
    started: float | None = None
    ended: float | None = None
    failure: Failure | None = None
    last_status: dict[str, dict[str, Any]] | None = None  # node -> nodestatus.NodeStatus.to_dict()
    last_seen: dict[str, float] = field(default_factory=dict)  # node -> last time its agent answered
    stop_pending: list[str] = field(default_factory=list)  # nodes whose processes could not be confirmed gone
    stop_results: dict[str, Any] | None = None
    stop_tried: float | None = None  # when a stop was last sent (retries of stop_pending are spaced by it)
    stopped_by_user: bool = False
    prediction: dict[str, Any] | None = None
    collected: dict[str, Any] | None = None
    watcher: dict[str, Any] | None = None  # {"pid", "started"} of the head-side watcher
    secrets: list[str] = field(default_factory=list)  # names of env values that are redacted everywhere
    left_out: dict[str, str] = field(default_factory=dict)  # the job's nodes it started without (min_nodes): why
    scheduler: str = "ssh"  # where it runs (cluster/schedulers): ssh (the inventory's PCs) or slurm
    target: dict[str, Any] | None = None  # the scheduler's own part: Slurm's {"cluster", "job_id", ...}
    # Membership (cluster/runs/elastic.py): one period per set of nodes the run ran on, the first from the
    # start; `dropped`: the nodes it lost on the way (node -> why, when, in which period, when it came back);
    # `reform`: who is restarting the survivors right now ({"pid", "since", "lost", "reason"}).
    periods: list[dict[str, Any]] = field(default_factory=list)
    dropped: dict[str, dict[str, Any]] = field(default_factory=dict)
    reform: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def move(self, to: str) -> bool:
        """Change the state if MOVES allows it (True also when already there); the end time comes with a
        final state. Every writer goes through here, so a late step never overwrites a stop or a verdict."""
        if to == self.state:
            return True
        if to not in MOVES.get(self.state, ()):
            return False
        self.state = to
        if to in FINAL and self.ended is None:
            self.ended = time.time()
        return True

    def node_dirs(self) -> dict[str, str]:
        return {n.node: n.run_dir for n in self.nodes}

    def members(self) -> list[str]:
        """The nodes the run runs on now: all of them, less those it lost and continued without."""
        return [n.node for n in self.nodes if n.node not in self.dropped]

    def hosts(self) -> list[Host]:
        """The hosts as they were when the run started (the inventory may have changed since). One whose key
        or known_hosts file, or a jump host's, is gone from this head (a lab rebuilt, a key replaced) can be
        reached no more as it was: it is reached as the current inventory reaches the same address and port,
        where that has it (its name, workdir and python stay the run's). Safe on another machine at that
        address: the node agent signals only processes whose boot and start it recorded, so there it answers
        that the run is not running."""
        snapshot = [Host.from_dict(d) for d in self.inventory["hosts"]]
        if not any(_files_gone(h) for h in snapshot):
            return snapshot
        now = _current_hosts()
        return [dataclasses.replace(now[(h.address, h.port)], name=h.name, workdir=h.workdir, python=h.python)
                if _files_gone(h) and (h.address, h.port) in now else h for h in snapshot]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        return {**extra, **d}

    @classmethod
    def from_dict(cls, d: Any, source: str = "run.json") -> RunRecord:
        if not isinstance(d, dict):
            raise RecordError(f"{source}: not a run record (a JSON object is expected)",
                              "remove the folder if the run is not needed, or restore the file")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kw = {k: v for k, v in d.items() if k in known}
        if "scheduler" not in d:  # a record from before the field: a Slurm run had a target of that kind
            kw["scheduler"] = str((d.get("target") or {}).get("kind") or "ssh") if isinstance(d.get("target"), dict) \
                else "ssh"
        try:
            kw["nodes"] = [RunNode(**n) for n in d["nodes"]]
            if kw.get("failure") is not None:
                kw["failure"] = Failure(**kw["failure"])
            rec = cls(**kw, extra={k: v for k, v in d.items() if k not in known})
            _check_types(rec)
        except (KeyError, TypeError, AttributeError) as e:
            raise RecordError(f"{source}: damaged run record ({type(e).__name__}: {e})",
                              "remove the folder if the run is not needed, or restore the file") from None
        return rec


def _check_types(r: RunRecord) -> None:
    """What the code relies on has the type it expects (a hand-edited record says where it is wrong)."""
    def bad(what: str) -> None:
        raise TypeError(f"{what} has the wrong type")

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if not isinstance(r.run_id, str) or not RUN_ID_RE.match(r.run_id):
        bad("run_id")
    for name in ("job", "framework", "state", "scheduler"):
        if not isinstance(getattr(r, name), str):
            bad(name)
    if not number(r.created) or not all(x is None or number(x) for x in (r.started, r.ended, r.stop_tried)):
        bad("created/started/ended")
    if not isinstance(r.inventory, dict) or not isinstance(r.inventory.get("hosts"), list) \
            or not all(isinstance(h, dict) and isinstance(h.get("name"), str) for h in r.inventory["hosts"]):
        bad("inventory.hosts")
    for n in r.nodes:
        if not (isinstance(n.node, str) and isinstance(n.run_dir, str) and isinstance(n.node_rank, int)
                and isinstance(n.nproc, int)):
            bad(f"nodes[{n.node!r}]")
    if not isinstance(r.last_seen, dict) or not all(number(v) for v in r.last_seen.values()):
        bad("last_seen")
    if not isinstance(r.stop_pending, list) or not all(isinstance(x, str) for x in r.stop_pending):
        bad("stop_pending")
    if not isinstance(r.periods, list) or not all(isinstance(p, dict) for p in r.periods):
        bad("periods")
    if not isinstance(r.dropped, dict) or not all(isinstance(v, dict) for v in r.dropped.values()):
        bad("dropped")
    for name in ("settings", "last_status", "stop_results", "prediction", "collected", "watcher", "reform"):
        v = getattr(r, name)
        if v is not None and not isinstance(v, dict):
            bad(name)
    for name in ("last_status", "stop_results"):  # node -> a dict each
        if not all(isinstance(v, dict) for v in (getattr(r, name) or {}).values()):
            bad(name)
    if r.failure is not None and not (isinstance(r.failure.node, str) and isinstance(r.failure.reason, str)
                                      and isinstance(r.failure.log, list) and isinstance(r.failure.also, list)
                                      and isinstance(r.failure.ranks, list)):
        bad("failure")


def runs_dir() -> Path:
    return paths.home() / "runs"


def new_run_id(job: str) -> str:
    return f"{job}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def run_path(run_id: str) -> Path:
    if not RUN_ID_RE.match(run_id):
        raise UsageError(f"'{run_id}' is not a run id", "see `clusterctl runs` for the ids")
    return runs_dir() / run_id


@contextmanager
def file_lock(path: Path, what: str, wait: float = LOCK_WAIT_S) -> Iterator[None]:
    """An exclusive flock on `path`, waited for at most `wait` seconds (never forever)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise ClusterError(f"{what} is locked by another clusterctl process (waited {wait:g} s)",
                                       f"wait for it to finish; the lock is {path}") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def lock(run_id: str) -> Any:
    return file_lock(run_path(run_id) / ".lock", f"run {run_id}")


def launch_lock() -> Any:
    """Held by a launch from its busy check until its record exists, so two launches cannot both pass."""
    return file_lock(runs_dir() / ".launch.lock", "starting a run", wait=600)


def save(record: RunRecord) -> Path:
    """Write the whole record (under its lock). Prefer `update` when another process may have written since."""
    d = run_path(record.run_id)
    runs_dir().mkdir(mode=0o700, parents=True, exist_ok=True)  # records may name secrets' sources
    d.mkdir(mode=0o700, exist_ok=True)
    with lock(record.run_id):
        paths.write_atomic(d / "run.json", json.dumps(record.to_dict(), indent=1, default=str) + "\n")
    return d / "run.json"


def update(run_id: str, change: Callable[[RunRecord], None]) -> RunRecord:
    """Read the newest record, apply `change`, write it back, all under the run's lock."""
    d = run_path(run_id)
    with lock(run_id):
        record = _read(d / "run.json")
        change(record)
        paths.write_atomic(d / "run.json", json.dumps(record.to_dict(), indent=1, default=str) + "\n")
    return record


def _read(p: Path) -> RunRecord:
    """Writers rename whole files, so a record never reads torn; a parse error is real damage and is reported."""
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"no run record {p}", "see `clusterctl runs` for the ids") from None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(f"{p}: unreadable run record ({e})",
                          "remove the folder if the run is not needed, or restore the file") from None
    return RunRecord.from_dict(doc, str(p))


def load(run_id: str | None = None) -> RunRecord:
    """A run by id (a unique prefix will do), or the latest one."""
    if run_id is None:
        records = list_runs()
        if not records:
            raise UsageError("no runs recorded yet", "start one: clusterctl launch resnet50-ddp")
        return records[-1]
    p = run_path(run_id) / "run.json"
    if not p.exists():
        matches = [r for r in list_runs() if r.run_id.startswith(run_id)]
        if len(matches) == 1:
            return matches[0]
        raise UsageError(f"no run '{run_id}'" + (f" ({len(matches)} runs start with it)" if matches else ""),
                         "see `clusterctl runs` for the ids")
    return _read(p)


def scan() -> tuple[list[RunRecord], list[RecordError]]:
    """Every recorded run, oldest first, and every record that could not be read (never dropped silently)."""
    out, bad = [], []
    d = runs_dir()
    for p in sorted(d.glob("*/run.json")) if d.exists() else []:
        try:
            out.append(_read(p))
        except RecordError as e:
            bad.append(e)
        except UsageError:
            continue  # removed between the listing and the read
    return sorted(out, key=lambda r: r.created if isinstance(r.created, (int, float)) else 0), bad


def list_runs() -> list[RunRecord]:
    """Every readable run, oldest first; a damaged record raises (callers that can go on use `scan`)."""
    records, bad = scan()
    if bad:
        raise bad[0]
    return records


def hosts(record: RunRecord) -> list[Host]:
    return record.hosts()


def _files_gone(h: Host) -> bool:
    """The head's files a host's connection needs, missing (SSH hosts; a local one needs none), its jump
    hosts' included (a gateway PC's lab rebuilt takes the gateway's known_hosts with it)."""
    if h.connection != "ssh":
        return False
    return ((h.key_path is not None and not h.key_path.exists()) or not h.known_hosts_path.exists()
            or any(_files_gone(j) for j in h.jumps))


def _current_hosts() -> dict[tuple[str, int], Host]:
    """The current inventory's hosts by address and port; none where it cannot be read (the snapshot then
    stands, and the connection says what is missing)."""
    from cluster.inventory import context, loader

    try:
        inv = loader.load(context.resolve(None)[0])
    except ClusterError:
        return {}
    return {(h.address, h.port): h for h in inv.hosts.values()}
