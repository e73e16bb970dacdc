"""The room's own Slurm (`provision --slurm`; `launch JOB --on ROOM`): Slurm queues the job and gives it whole
PCs; clusterctl then runs it on those PCs exactly as an SSH run (files staged with the code cache and relay,
the provisioned environment, logs, stop and collect per PC over SSH). Nothing is shared but the network.

    submit     sbatch on the controller of a job that holds N whole PCs (its batch script only waits, on the
               first PC, for the run's end there); the record is `queued` with Slurm's reason and position
    waiter     a process of the head (cluster.schedulers.roomwait) asks squeue until the job runs, then
               launches the run on the PCs Slurm allocated (runs.launch, the same run id)
    run        an SSH run whose record keeps the Slurm job (`target`); at its end the job is cancelled, and
               the batch script ends by itself once the run's program ended on its PC
"""
from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

from cluster import __version__
from cluster.errors import EXIT_UNREACHABLE, ClusterError, TransportError, UsageError
from cluster.inventory.model import Host, RoomCluster
from cluster.room import asleep
from cluster.runs import collect as run_collect, launch, records
from cluster.runs.render import LaunchRequest
from cluster.schedulers import ssh
from cluster.schedulers.interface import Log, Logs, OnUpdate, Option, Submission
from cluster.slurm.run import LIVE, SUBMIT_GRACE_S, by_name, job_state
from cluster.transport import transport_for

KIND = "room"
FOLLOW_S = 2.0
NO_RUN_S = 600  # the batch script gives the PCs back if the run never started on its PC within this


@dataclasses.dataclass
class RoomRequest:
    """What `launch --on ROOM` submits: the Slurm job holding N PCs, and the SSH launch as on the room's first
    N PCs (what --dry-run shows; the real one is rendered for the PCs Slurm gives)."""

    run_id: str
    room: RoomCluster
    nodes: int
    time: str | None
    launch: LaunchRequest
    inventory: dict[str, Any]  # path and --host-set: how the waiter reads the inventory again

    def batch_script(self) -> str:
        """The job's batch script: on the allocation's first PC, wait for the run's end there (its exit.json),
        or give the PCs back if the run never starts there."""
        cases = "".join(f"  {shlex.quote(h['name'])}) d={shlex.quote(h['workdir'] + '/runs/' + self.run_id)};;\n"
                        for h in self.inventory.get("hosts", []))
        return (f"#!/bin/sh\n# clusterctl run {self.run_id}: holds these PCs while clusterctl runs it on them\n"
                f"case \"$(hostname)\" in\n{cases}  *) exit 0;;\nesac\n"
                f"case \"$d\" in /*) ;; *) d=\"$HOME/$d\";; esac\n"
                f"waited=0\nwhile [ ! -e \"$d/exit.json\" ]; do\n"
                f"  if [ ! -d \"$d\" ] && [ \"$waited\" -ge {NO_RUN_S} ]; then exit 0; fi\n"
                f"  sleep 5; waited=$((waited + 5))\ndone\n")

    def sbatch(self) -> str:
        """--requeue: a job whose PCs fail (one that does not wake from power saving, marked down) goes back to
        the queue for PCs that answer, rather than failing."""
        words = ["sbatch", "--parsable", f"--job-name={self.run_id}", f"--partition={self.room.partition}",
                 f"--nodes={self.nodes}", "--exclusive", "--requeue", "--output=/dev/null"]
        if self.time:
            words.append(f"--time={self.time}")
        return shlex.join(words)

    def to_dict(self) -> dict[str, Any]:
        return {**self.launch.to_dict(), "room": self.room.name, "slurm": {
            "sbatch": self.sbatch(), "batch_script": self.batch_script(), "nodes": self.nodes,
            "controller": self.room.controller.address}}

    def to_text(self, width: int = 100) -> str:
        return (self.launch.to_text(width) +
                f"on the room's Slurm ({self.room.name}): `{self.sbatch()}` on {self.room.controller.address}; the "
                f"files above are rendered for its first {self.nodes} PCs, the run gets those Slurm gives; nothing "
                "was submitted\n")


class RoomScheduler:
    name = KIND
    title = "on the room's own Slurm (provision --slurm)"
    options: tuple[Option, ...] = (
        Option("nodes", "with --on: how many nodes (default: as many as the job uses on the inventory's hosts)", "N",
               "positive"),
        Option("time", "with --on: the time limit, e.g. 30, 2:00:00, 1-12:00:00", "T"),
    )
    refuses: dict[str, str] = {
        "limit": "--limit picks PCs; the room's Slurm gives a job its PCs (--nodes N says how many)",
        "plan": "--plan places the job on chosen PCs; the room's Slurm gives --nodes N PCs",
        "wake": "--wake wakes PCs clusterctl picks; the room's Slurm gives its job PCs that answer",
        "poweroff_after": "--poweroff-after powers off PCs that Slurm may give to the next job",
        "continue_run": "--continue needs the PCs that hold the run's checkpoints, which the room's Slurm may "
                        "give to others; launch it without --on"}
    continues_runs = False

    def pcs(self, sub: Submission) -> list[Host] | None:
        return None  # Slurm picks

    def dryrun(self, sub: Submission, log: Log = lambda s: None) -> RoomRequest:
        assert sub.on is not None
        room = sub.inventory.rooms[sub.on]
        n = sub.nodes or sub.options.get("nodes") or len(room.nodes)
        if n > len(room.nodes):
            raise UsageError(f"--nodes {n}: room {room.name} has {len(room.nodes)} PCs ({', '.join(room.nodes)})",
                             f"--nodes {len(room.nodes)} or fewer")
        first = ",".join(room.nodes[:n])
        try:
            request = launch.prepare(sub.inventory, sub.spec, limit=first, forks=sub.forks, log=log)
        except ClusterError as e:
            if room.suspend_after is None or e.exit_code != EXIT_UNREACHABLE:
                raise
            log(f"{first}: not answering; room {room.name}'s Slurm switches idle PCs off (suspend_after) and wakes "
                "those it gives the run: it is checked on them then")
            request = launch.prepare(sub.inventory, sub.spec, limit=first, log=log, unchecked=True)
        inv = {"path": str(sub.inventory.path), "name": sub.inventory.name, "overrides": list(sub.inventory.overrides),
               "hosts": [sub.inventory.hosts[h].to_dict() for h in room.nodes]}
        return RoomRequest(request.run_id, room, n, sub.options.get("time"), request, inv)

    def submit(self, request: Any, log: Log = lambda s: None, prediction: dict[str, Any] | None = None,
               watch: bool = True, forks: int = 32) -> records.RunRecord:
        assert isinstance(request, RoomRequest)
        record = _record(request)
        records.save(record)  # before sbatch: a lost answer leaves a record that finds its job by name
        with transport_for(request.room.controller) as t:
            r = t.run(request.sbatch(), timeout=120, stdin=request.batch_script().encode())
        job_id = (r.stdout.strip().splitlines() or [""])[-1].split(";")[0].strip()
        if r.exit_code != 0 or not job_id.isdigit():
            why = f"sbatch refused the job (exit {r.exit_code}): {(r.stderr or r.stdout).strip()[-500:]}"
            records.update(record.run_id, lambda rec: _fail(rec, why))
            raise ClusterError(why, f"run `{request.sbatch()}` by hand on {request.room.controller.address}")
        log(f"submitted: Slurm job {job_id} on room {request.room.name}")
        record = records.update(record.run_id, lambda rec: _queued(rec, job_id))
        spawn_waiter(record.run_id)
        return record

    def describe(self, record: records.RunRecord) -> records.RunRecord:
        if _waiting(record):
            record = queue_state(record)
            if record.state == "queued" and _waiter_gone(record):  # killed, or the head rebooted: a new one
                spawn_waiter(record.run_id)
            return record
        record = ssh.SCHEDULER.describe(record)
        if record.active and _waiter_gone(record):  # the run's guard (its job ended: the run stops) is back
            spawn_waiter(record.run_id)
        return release(record)

    def follow(self, record: records.RunRecord, on_update: OnUpdate | None = None) -> records.RunRecord:
        while _waiting(record):  # bounded: Slurm's queue (a job waits as long as the room is busy; Ctrl-C detaches)
            record = queue_state(record)
            if on_update:
                on_update(record, {})
            if _waiting(record):
                time.sleep(FOLLOW_S)
                record = records.load(record.run_id)
        if record.nodes:
            record = ssh.SCHEDULER.follow(record, on_update)
        return release(record)

    def logs(self, record: records.RunRecord, node: str | None = None, lines: int = 50) -> Logs:
        return ssh.SCHEDULER.logs(record, node, lines) if record.nodes else Logs({})

    def log_iter(self, record: records.RunRecord, node: str | None = None,
                 unreachable: set[str] | None = None) -> Iterator[tuple[str, str]]:
        while _waiting(record):  # bounded as follow
            time.sleep(FOLLOW_S)
            record = records.load(record.run_id)
        if record.nodes:
            yield from ssh.SCHEDULER.log_iter(record, node, unreachable)

    def stop(self, record: records.RunRecord, grace: float = 10.0) -> records.RunRecord:
        if record.nodes:
            record = ssh.SCHEDULER.stop(record, grace)
        else:
            _cancel(record)
            record = records.update(record.run_id, lambda r: _stopped(r))
        return release(record)

    def collect(self, record: records.RunRecord, checkpoints: bool = False, forks: int = 32,
                on_bytes: Callable[[str, int], None] | None = None,
                inventory_hosts: dict[str, Host] | None = None) -> dict[str, run_collect.NodeCollect]:
        if not record.nodes:
            return {}
        tg = record.target or {}  # PCs Slurm switched off since the run: woken through it first, and said so
        woke = asleep.wake(controller_of(record), tg.get("partition") or "", [n.node for n in record.nodes])
        got = ssh.SCHEDULER.collect(record, checkpoints, forks, on_bytes, inventory_hosts)
        for name in woke:
            if name in got:
                got[name].woke = "switched off by the room's Slurm since the run: woken through it (srun) to collect"
        return got

    def where(self, record: records.RunRecord) -> str:
        tg = record.target or {}
        head = f"Slurm job {tg.get('job_id') or '?'} on room {tg.get('cluster', '?')}"
        if record.state != "queued":
            return head if record.nodes else f"{head}: {tg.get('state', '?')}"
        if tg.get("state") == "CONFIGURING":  # its PCs powering up (the room's power saving)
            return f"{head}: Slurm gave it {tg.get('nodelist') or '?'}, waking them"
        if tg.get("state") == "RUNNING":
            return f"{head}: Slurm gave it {tg.get('nodelist') or '?'}, starting there"
        pos = tg.get("position")
        reason = tg.get("reason")
        return (f"{head}: queued" + (f" ({reason})" if reason else "") +
                (f", {_nth(pos)} in the queue" if pos else ""))

    def details(self, record: records.RunRecord) -> list[str]:
        return ssh.SCHEDULER.details(record) if record.nodes else []


def spawn_waiter(run_id: str) -> int:
    """Start the run's waiter (cluster.schedulers.roomwait) detached from this process and its terminal."""
    with open(records.run_path(run_id) / "roomwait.log", "ab") as out:
        p = subprocess.Popen(  # bounded: started, never waited for
            [sys.executable, "-m", "cluster.schedulers.roomwait", run_id], stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, cwd=records.run_path(run_id))
    return p.pid


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _waiting(record: records.RunRecord) -> bool:
    """Slurm has not given it PCs yet, or the waiter is launching on them (`starting`: the run's folders are not
    all there yet, and only the launch judges that phase), unless that waiter died midway (judged as SSH)."""
    if not record.active:
        return False
    return not record.nodes or (record.state == "starting" and not _waiter_gone(record))


def _record(request: RoomRequest) -> records.RunRecord:
    spec = request.launch.job
    return records.RunRecord(
        run_id=request.run_id, job=spec.name, framework=spec.framework, state="starting", created=time.time(),
        clusterctl=__version__, settings=spec.settings, spec_file=str(spec.path),
        world_size=request.launch.world_size, scheduler=KIND, data_file=request.launch.data_file, nodes=[],
        inventory={**request.inventory, "hosts": []},  # no PC is the run's until Slurm gives it some
        target={"kind": KIND, "cluster": request.room.name, "job_id": None, "state": "SUBMITTING",
                "controller": request.room.controller.to_dict(), "nodes": request.nodes,
                "inventory": request.inventory, "partition": request.room.partition})


def _queued(r: records.RunRecord, job_id: str) -> None:
    assert r.target is not None
    r.target.update({"job_id": job_id, "state": "PENDING"})
    r.move("queued")


def _fail(r: records.RunRecord, why: str) -> None:
    r.failure = records.Failure(node=(r.target or {}).get("cluster", "?"), reason=why)
    r.move("failed")


def _stopped(r: records.RunRecord) -> None:
    (r.target or {}).update({"state": "CANCELLED", "reason": "", "position": None})
    r.stopped_by_user = True
    if r.state not in ("stopping",):
        r.move("stopping")
    r.move("stopped")


def controller_of(record: records.RunRecord) -> Host:
    assert record.target is not None
    return Host.from_dict(record.target["controller"])


def _waiter_gone(record: records.RunRecord) -> bool:
    """No process holds the run's waiter lock (roomwait takes it for its whole life)."""
    try:
        with records.file_lock(records.run_path(record.run_id) / ".roomwait.lock", "the waiter's lock", wait=0):
            return True
    except ClusterError:
        return False


def queue_state(record: records.RunRecord) -> records.RunRecord:
    """Where the held job stands in the room's queue: Slurm's state and reason, and its place among the
    pending jobs of the partition (by Slurm's priority order). An unreachable controller changes nothing."""
    tg = record.target or {}
    job = tg.get("job_id")
    try:
        with transport_for(controller_of(record)) as t:
            if not job:  # sbatch's answer was lost (or a Ctrl-C came first): the job has the run's name
                job = by_name(t, record.run_id)
                if job is None:
                    if time.time() - record.created < SUBMIT_GRACE_S:
                        return record  # the launch may still be submitting
                    return records.update(record.run_id, lambda r: _fail(
                        r, f"Slurm has no job named {record.run_id}: sbatch's answer was lost before it queued one"))
                record = records.update(record.run_id, lambda r: _queued(r, str(job)))
            state, reason, nodelist = job_state(t, job)
            order = t.run(f"squeue -h -t PD -p {shlex.quote(tg.get('partition') or '')} --sort=-p,i -o %i",
                          timeout=60).stdout.split()
    except TransportError:
        return record
    position = order.index(job) + 1 if job in order else None

    def apply(r: records.RunRecord) -> None:
        assert r.target is not None
        given = state in ("RUNNING", "CONFIGURING")  # squeue's %R is then the node list, not a reason
        r.target.update({"state": state, "reason": "" if given else reason, "nodelist": nodelist,
                         "position": position, "seen": time.time()})
        if state not in LIVE and not r.nodes and r.active:
            _fail(r, f"Slurm ended job {job} ({state}{', ' + reason if reason else ''}) before clusterctl started "
                     "the run on its PCs")

    return records.update(record.run_id, apply)


def _cancel(record: records.RunRecord) -> None:
    job = (record.target or {}).get("job_id")
    if not job:
        return
    with transport_for(controller_of(record)) as t:
        t.run(f"scancel {shlex.quote(str(job))}", timeout=60)


def release(record: records.RunRecord) -> records.RunRecord:
    """A run that ended gives its PCs back to Slurm (its job cancelled), once; best effort: the batch script
    ends by itself when the run's program ended on its PC."""
    tg = record.target or {}
    if record.active or tg.get("released") or not tg.get("job_id"):
        return record
    try:
        _cancel(record)
    except (TransportError, ClusterError):
        return record
    return records.update(record.run_id, lambda r: (r.target or {}).update({"released": time.time()}))


@dataclasses.dataclass(frozen=True)
class OthersJob:
    """A run this head has no record of, found in a room's Slurm by its name (the job's name is the run id):
    another student's, or one's own from another head. Slurm alone decides who may cancel it."""

    room: str
    job_id: str
    user: str
    state: str
    pcs: str
    cancelled: bool
    answer: str  # scancel's own words: Slurm's refusal, as it said it

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def refusal(self, run: str) -> str:
        on = f", on {self.pcs}" if self.pcs else ""
        return (f"run {run} is Slurm job {self.job_id} of user {self.user} on room {self.room} "
                f"({self.state.lower()}{on}), not yours: Slurm refused to cancel it: {self.answer}")


def parse_owner(out: str) -> tuple[str, str, str, str] | None:
    """`squeue -h -n RUN -o %i|%u|%T|%N`'s line -> (job, user, state, PCs), None when Slurm has no such job."""
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0].isdigit():
            return parts[0], parts[1], parts[2], parts[3]
    return None


def stop_by_name(rooms: list[RoomCluster], run_id: str) -> OthersJob | None:
    """`stop RUN` of a run not recorded here: its job, looked up by name in each room's Slurm, cancelled as this
    user (scancel on the controller), or Slurm's refusal; None where no room's Slurm has it."""
    for room in rooms:
        with transport_for(room.controller) as t:
            found = parse_owner(t.run(f"squeue -h -n {shlex.quote(run_id)} -o '%i|%u|%T|%N'", timeout=60).stdout)
            if found is None:
                continue
            job, user, state, pcs = found
            r = t.run(f"scancel {shlex.quote(job)}", timeout=60)
        return OthersJob(room.name, job, user, state, pcs, r.exit_code == 0, (r.stderr or r.stdout).strip()[-500:])
    return None


SCHEDULER = RoomScheduler()
