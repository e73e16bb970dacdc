"""A run on a Slurm cluster: submitted over SSH on its login node, judged by Slurm, stopped with scancel, its
job folder brought back to the head.

The run record is an SSH run's (runs/<id>/run.json) with `target` = {"kind": "slurm", "cluster", "job_id",
"login" (the host snapshot), "workdir", "run_dir"}: `status`, `logs`, `stop` and `collect` read it and come
here. The verdict is Slurm's: squeue while the job lives (`-t all` keeps a finished job a few minutes),
then `sacct -c` (the cluster's jobcomp file; full accounting where it has slurmdbd), then the tasks' own
exit.json files. Each task is one node of the allocation: the record's nodes are the tasks' nodes, from
their task.json, once they ran.
"""
from __future__ import annotations

import dataclasses
import json
import posixpath
import shlex
import time
from pathlib import Path
from typing import Any, Callable

from cluster import __version__
from cluster.errors import ClusterError, TransportError
from cluster.inventory.model import Host
from cluster.runs import code, collect as run_collect, datasets, payload, records as runs
from cluster.runs.render import AGENT
from cluster.slurm import facts, fit, layout
from cluster.slurm.submit import SlurmRequest
from cluster.transport import Transport, transport_for

Log = Callable[[str], None]
KIND = "slurm"
# Slurm's job states (squeue %T, sacct State) -> the run's state
LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
        "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT")
FAILED = ("FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")
STOP_WAIT_S = 60.0  # scancel, then at most this long until Slurm says the job ended
SUBMIT_GRACE_S = 120.0  # a record without a job id younger than this: its launch may still be submitting
# A job neither squeue nor sacct knows, with no task folder, this long: Slurm forgot it (past MinJobAge, no
# accounting) before any task started. The run fails saying so instead of being waited for without end.
FORGOTTEN_S = 300.0


def target(record: runs.RunRecord) -> dict[str, Any]:
    """The record's Slurm part (a Slurm run's record always has one)."""
    if record.target is None:
        raise ClusterError(f"run {record.run_id} did not run on a Slurm cluster", "see `clusterctl runs`")
    return record.target


def login_of(record: runs.RunRecord) -> Host:
    assert record.target is not None
    return Host.from_dict(record.target["login"])


def _agent_host(record: runs.RunRecord) -> Host:
    """The login node as collect's agent sees it: the agent staged under the cluster's workdir, run by the
    login node's own python3 (the node agent needs the standard library only)."""
    assert record.target is not None
    return dataclasses.replace(login_of(record), workdir=record.target["workdir"], python="python3")


def _run(t: Transport, command: str, what: str, timeout: float = 120) -> str:
    r = t.run(command, timeout=timeout)
    if r.exit_code != 0:
        raise ClusterError(f"{t.host.name}: {what} failed (exit {r.exit_code}): "
                           f"{(r.stderr or r.stdout).strip()[-600:]}",
                           "check the cluster with the same command on its login node")
    return r.stdout


# --------------------------------------------------------------------------- submission


def submit(request: SlurmRequest, log: Log = lambda s: None) -> runs.RunRecord:
    """Check the request against the partition (sinfo), stage the run folder on the shared filesystem, run
    sbatch, record the run (`running`: Slurm queues it). Refusals before sbatch submit nothing."""
    spec, cluster = request.job, request.cluster
    with transport_for(cluster.login) as t:
        parts = facts.parse_sinfo(_run(t, f"sinfo -h -N -o {shlex.quote(facts.SINFO_FORMAT)}", "sinfo"), 0)
        for note in fit.check(parts, request.resources):  # exit 2 when the partition cannot give it
            log(note)
        rdir = request.run_dir
        q = shlex.quote
        _run(t, f"mkdir -p -- {q(rdir + '/program')} {q(rdir + '/clusterctl')} {q(cluster.workdir + '/datasets')} "
                f"{q(cluster.workdir + '/clusterctl')} && chmod 700 -- {q(rdir)}", "making the run folder")
        _stage_tree(t, payload.program_tree(spec), f"{rdir}/program", log, "program")
        if spec.own and spec["data"] is not None:
            _stage_data(t, spec, f"{rdir}/data", log)
        if not spec.own:
            _stage_dataset(t, spec, layout.dataset(cluster.workdir, request.data_file), log)
        for dest, src in layout.HELPERS.items():
            t.put_bytes(src.read_bytes(), f"{rdir}/{dest}")
        for helper, blob in payload.agent_files().items():  # collect lists the tasks' files with it
            t.put_bytes(blob, f"{cluster.workdir}/{posixpath.dirname(AGENT)}/{helper}")
        secret = payload.secret_values(spec)
        if secret:
            t.put_bytes(payload.secrets_file(secret).encode(), f"{rdir}/{layout.SECRETS}", mode=0o600)
        for name, content in request.files.items():
            t.put_bytes(content.encode(), f"{rdir}/{name}", mode=0o600)
        # recorded before sbatch: a lost answer or a Ctrl-C after it leaves a record that finds its job by name
        record = _record(request)
        runs.save(record)
        try:
            r = t.run(f"cd -- {q(rdir)} && sbatch --parsable {q(layout.BATCH_SCRIPT)}", timeout=120)
        except BaseException:
            runs.update(record.run_id, lambda rec: _note(rec, "sbatch's answer was lost: the job, if Slurm has "
                                                          "it, is found by its name (the run id)"))
            raise
    out = r.stdout.strip()
    job_id = out.splitlines()[-1].split(";")[0].strip() if out else ""
    if r.exit_code != 0 or not job_id.isdigit():
        why = f"sbatch refused the job (exit {r.exit_code}): {(r.stderr or out).strip()[-500:]}"
        runs.update(record.run_id, lambda rec: _refused(rec, why))
        raise ClusterError(why, "run the same sbatch by hand on the login node to see why")
    log(f"submitted: Slurm job {job_id} on {cluster.name}")
    return runs.update(record.run_id, lambda rec: _submitted(rec, job_id))


def _record(request: SlurmRequest) -> runs.RunRecord:
    spec, cluster, res = request.job, request.cluster, request.resources
    return runs.RunRecord(
        run_id=request.run_id, job=spec.name, framework=spec.framework, state="starting", created=time.time(),
        clusterctl=__version__, settings=spec.settings, spec_file=str(spec.path), world_size=res.world_size,
        scheduler=KIND,
        data_file=request.data_file, nodes=[], inventory={"path": "", "name": cluster.name, "hosts": []},
        target={"kind": KIND, "cluster": cluster.name, "job_id": None, "login": cluster.login.to_dict(),
                "workdir": cluster.workdir, "run_dir": request.run_dir, "state": "SUBMITTING",
                "resources": res.to_dict()})


def _submitted(r: runs.RunRecord, job_id: str) -> None:
    """Slurm has the job: `queued` until it says RUNNING (_apply), with its reason."""
    assert r.target is not None
    r.target.update({"job_id": job_id, "state": "PENDING"})
    r.move("queued")


def _refused(r: runs.RunRecord, why: str) -> None:
    r.failure = runs.Failure(node=(r.target or {}).get("cluster", "?"), reason=why)
    r.move("failed")


def _note(r: runs.RunRecord, text: str) -> None:
    assert r.target is not None
    r.target["note"] = text


def _stage_tree(t: Transport, tree: code.CodeTree, into: str, log: Log, what: str) -> None:
    """A code tree into a folder of the shared filesystem: each file whose sha256 differs (once per cluster,
    not per node: every node reads it there)."""
    have = _remote_sums(t, into, list(tree.files))
    sent = 0
    for rel, f in tree.files.items():
        if have.get(rel) != f.sha256:
            dest = f"{into}/{rel}"
            t.run(f"mkdir -p -- {shlex.quote(str(Path(dest).parent))}", timeout=60)
            t.put_file(tree.root / rel, dest, mode=f.mode)
            sent += f.size
    log(f"{what}: {len(tree.files)} files, {sent} bytes sent to the cluster")


def _remote_sums(t: Transport, root: str, rels: list[str]) -> dict[str, str]:
    if not rels:
        return {}
    q = " ".join(shlex.quote(r) for r in rels)
    r = t.run(f"cd -- {shlex.quote(root)} 2>/dev/null && sha256sum -- {q} 2>/dev/null", timeout=600)
    out = {}
    for line in r.stdout.splitlines():
        digest, _, rel = line.partition("  ")
        out[rel] = digest
    return out


def _stage_data(t: Transport, spec: Any, into: str, log: Log) -> None:
    tree = payload.data_tree(spec)
    _stage_tree(t, tree, into if tree.root.is_dir() else str(Path(into).parent), log, "data")


def _stage_dataset(t: Transport, spec: Any, dest: str, log: Log) -> None:
    prepared = datasets.prepare(spec, log)
    have = _remote_sums(t, str(Path(dest).parent), [Path(dest).name]).get(Path(dest).name)
    if have != prepared.sha256:
        t.send_file(prepared.path, dest)
        log(f"dataset {prepared.file_name}: {prepared.size} bytes sent to the cluster")


# --------------------------------------------------------------------------- what Slurm says


def job_state(t: Transport, job_id: str) -> tuple[str, str, str]:
    """(state, reason, node list) of the job: squeue while it is known, else sacct -c (jobcomp)."""
    r = t.run(f"squeue -h -t all -j {job_id} -o '%T|%R|%N' 2>/dev/null", timeout=60)
    line = next((x for x in r.stdout.splitlines() if x.strip()), "")
    if r.exit_code == 0 and line:
        state, _, rest = line.partition("|")
        reason, _, nodelist = rest.partition("|")
        reason = reason.strip()  # a pending job's reason comes in parentheses: "(Resources)"
        if reason.startswith("(") and reason.endswith(")"):
            reason = reason[1:-1]
        return state.strip().split()[0], "" if reason == "None" else reason, nodelist.strip()
    r = t.run(f"sacct -c -n -P -j {job_id} -o JobID,State,ExitCode,NodeList 2>/dev/null", timeout=60)
    rows = [x.split("|") for x in r.stdout.splitlines() if x.startswith(job_id)]
    if rows:  # a requeued job has several lines: the last is where it stands
        row = rows[-1]
        return row[1].split()[0], f"exit {row[2]}" if len(row) > 2 else "", row[3] if len(row) > 3 else ""
    return "UNKNOWN", "neither squeue nor sacct -c knows the job (the cluster keeps no accounting)", ""


TASKS_SCRIPT = ("cd -- {rdir} 2>/dev/null || exit 0; for d in task-*; do [ -d \"$d\" ] || continue; "
                "echo \"@@task $d\"; cat \"$d/task.json\" 2>/dev/null; echo; echo @@exit; cat \"$d/exit.json\" "
                "2>/dev/null; echo; echo @@log; tail -n {lines} \"$d/node.log\" 2>/dev/null; done")


def _tasks(t: Transport, rdir: str, lines: int = 20) -> dict[int, dict[str, Any]]:
    """Each task's task.json, exit.json and log tail, from the job's folder."""
    r = t.run(TASKS_SCRIPT.format(rdir=shlex.quote(rdir), lines=int(lines)), timeout=60)
    out: dict[int, dict[str, Any]] = {}
    for chunk in r.stdout.split("@@task ")[1:]:
        name, _, rest = chunk.partition("\n")
        info, _, rest = rest.partition("@@exit\n")
        ended, _, tail = rest.partition("@@log\n")
        try:
            index = int(name.strip().removeprefix("task-"))
        except ValueError:
            continue
        out[index] = {"task": _json(info), "exit": _json(ended), "log": tail.splitlines()}
    return out


def _json(text: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(text.strip() or "null")
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def refresh(record: runs.RunRecord) -> runs.RunRecord:
    """Ask the cluster where the job stands and record it; a final record is not asked again. An
    unreachable login node changes nothing (TransportError: exit 3 for `status`)."""
    if not record.active:
        return record
    tg = target(record)
    with transport_for(login_of(record)) as t:
        if tg.get("job_id") is None:
            found = by_name(t, record.run_id)
            if found is None:
                if time.time() - record.created < SUBMIT_GRACE_S:
                    return record  # sbatch may still be answering the launch that records it
                return runs.update(record.run_id, lambda r: _refused(
                    r, f"Slurm has no job named {record.run_id}: sbatch's answer was lost before it queued one"))
            record = runs.update(record.run_id, lambda r: _submitted(r, found))
            tg = target(record)
        state, reason, nodelist = job_state(t, tg["job_id"])
        tasks = _tasks(t, tg["run_dir"])
        down = _down_nodes(t) if state not in ("RUNNING", "COMPLETED", "COMPLETING") else set()
    return runs.update(record.run_id, lambda r: _apply(r, state, reason, nodelist, tasks, down))


def _down_nodes(t: Transport) -> set[str]:
    """The nodes Slurm has marked down or failing (sinfo's `*`: not responding): the node a job lost."""
    r = t.run("sinfo -h -N -o '%N %T' 2>/dev/null", timeout=60)
    out = set()
    for line in r.stdout.splitlines():
        words = line.split()
        if len(words) >= 2 and words[1].rstrip("*~#!%$@^-").lower() in ("down", "fail", "failing", "drain",
                                                                         "drained", "draining", "unknown"):
            out.add(words[0])
    return out


def by_name(t: Transport, run_id: str) -> str | None:
    """The job Slurm holds under this run's name (sbatch --job-name is the run id), the newest."""
    r = t.run(f"squeue -h -t all -n {shlex.quote(run_id)} -o %i 2>/dev/null", timeout=60)
    ids = [x.strip() for x in r.stdout.split() if x.strip().isdigit()]
    return max(ids, key=int) if r.exit_code == 0 and ids else None


def _apply(r: runs.RunRecord, state: str, reason: str, nodelist: str, tasks: dict[int, dict[str, Any]],
           down: set[str] | None = None) -> None:
    assert r.target is not None
    r.target.update({"state": state, "reason": reason, "nodelist": nodelist, "seen": time.time()})
    rdir = r.target["run_dir"]
    nproc = int((r.target.get("resources") or {}).get("nproc_per_node") or 1)
    named = {i: (v["task"] or {}).get("node") for i, v in tasks.items()}
    if named and all(named.values()):
        r.nodes = [runs.RunNode(str(named[i]), i, nproc, f"{rdir}/task-{i}") for i in sorted(named)]
    r.last_status = {str(named.get(i) or f"task-{i}"): {
        "state": "exited" if v["exit"] else ("running" if state in LIVE else state.lower()),
        "exit_code": (v["exit"] or {}).get("code"), "log_tail": v["log"][-20:]} for i, v in tasks.items()}
    if state in LIVE and state != "RUNNING" and tasks and any(v["task"] for v in tasks.values()):
        # it ran and waits again: Slurm requeued it (requeue: true) after it lost a node; the lost node's
        # task left no exit code, the others were ended by srun -K
        lost = _lost(named, tasks, down)
        r.target["requeued"] = {"lost": lost or [nodelist or "?"], "reason": reason, "seen": time.time()}
    if state in ("RUNNING", "COMPLETING", "CONFIGURING"):  # CONFIGURING: its nodes are allocated (booting)
        if r.move("running") and r.started is None:
            r.started = time.time()
    elif state in LIVE and r.state != "stopping":  # PENDING, or waiting again after a requeue
        r.move("queued")
    if state == "UNKNOWN" and not tasks:
        since = r.target.setdefault("unknown_since", time.time())
        if time.time() - since < FORGOTTEN_S:
            return
        r.failure = runs.Failure(node=nodelist or "?", reason=f"Slurm no longer knows job {r.target.get('job_id')} "
                                 f"and none of its tasks started ({reason})")
        r.move("failed")
        return
    r.target.pop("unknown_since", None)
    if state in LIVE:
        return
    if r.started is None:  # it ran and ended between two looks: its wait counts as its run
        r.started = r.created
    if state != "CANCELLED" and r.state in ("starting", "queued"):
        r.move("running")  # a verdict comes from running (MOVES): a job seen waiting, then done, did run
    codes = {i: (v["exit"] or {}).get("code") for i, v in tasks.items()}
    if state == "COMPLETED" and tasks and all(c == 0 for c in codes.values()):
        r.move("succeeded")
    elif state == "CANCELLED" or r.state == "stopping":
        r.stopped_by_user = r.stopped_by_user or r.state == "stopping"
        r.move("stopped")
    else:
        bad = next((i for i, c in sorted(codes.items()) if c not in (0, None)), None)
        lost = _lost(named, tasks, down)
        node = nodelist or "?"
        if state == "NODE_FAIL" and lost:
            node, bad = ", ".join(lost), None
        elif bad is not None:
            node = str(named.get(bad) or f"task-{bad}")
        why = {"NODE_FAIL": f"Slurm lost node {node} of {nodelist or '?'} (NODE_FAIL)",
               "TIMEOUT": "the job ran past its time limit (TIMEOUT)",
               "OUT_OF_MEMORY": "a task ran out of memory (OUT_OF_MEMORY)"}.get(
            state, f"Slurm says {state}" + (f" ({reason})" if reason else ""))
        if bad is not None and state not in ("NODE_FAIL", "TIMEOUT"):
            why = f"task {bad} exited {codes[bad]} ({state})"
        r.failure = runs.Failure(node=node, reason=why, log=tasks.get(bad, {}).get("log", [])[-20:] if bad is not None
                                 else [])
        r.move("failed")


def _lost(named: dict[int, Any], tasks: dict[int, dict[str, Any]], down: set[str] | None) -> list[str]:
    """The job's nodes Slurm lost: those it marks down now; else those whose task left no exit code (a node
    that died took its task with it; srun -K ended the others, which wrote theirs)."""
    nodes = [str(named.get(i) or f"task-{i}") for i in sorted(tasks)]
    marked = [n for n in nodes if n in (down or set())]
    return marked or [str(named.get(i) or f"task-{i}") for i, v in sorted(tasks.items()) if not v["exit"]]


def follow(record: runs.RunRecord, interval: float = 2.0,
           on_update: Callable[[runs.RunRecord], None] = lambda r: None) -> runs.RunRecord:
    """Ask until the job ends; each answer to `on_update`. A login node that stops answering is asked again
    (the job goes on without clusterctl); the wait is Slurm's own time limit, which every job has."""
    while record.active:
        try:
            record = refresh(record)
        except TransportError:
            pass
        on_update(record)
        if record.active:
            time.sleep(interval)
    return record


# --------------------------------------------------------------------------- stop, logs, collect


def stop(record: runs.RunRecord) -> runs.RunRecord:
    """scancel, then wait (bounded) until Slurm says the job ended; `stopped`."""
    record = runs.update(record.run_id, _stopping)
    with transport_for(login_of(record)) as t:
        job_id = target(record).get("job_id") or by_name(t, record.run_id)
        if job_id is None:  # never queued (sbatch's answer lost, or refused): nothing to cancel
            return runs.update(record.run_id, lambda r: _stopped(r, "CANCELLED", {}))
        _run(t, f"scancel {job_id}", "scancel")
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            state, _, _ = job_state(t, job_id)
            if state not in LIVE:
                break
            time.sleep(1.0)
        else:
            raise ClusterError(f"Slurm job {job_id} still {state} {STOP_WAIT_S:g} s after scancel",
                               f"check `squeue -j {job_id}` on the login node and run `clusterctl stop` again")
        tasks = _tasks(t, target(record)["run_dir"])
    return runs.update(record.run_id, lambda r: _stopped(r, state, tasks))


def _stopping(r: runs.RunRecord) -> None:
    r.move("stopping")


def _stopped(r: runs.RunRecord, state: str, tasks: dict[int, dict[str, Any]]) -> None:
    _apply(r, state, "scancel", "", tasks)
    r.stopped_by_user = True
    r.move("stopped")
    r.stop_results = {"slurm": {"ok": True, "state": state}}


def logs(record: runs.RunRecord, lines: int = 50) -> dict[str, str]:
    """Each task's last lines (its node.log on the shared filesystem), by node name."""
    with transport_for(login_of(record)) as t:
        tasks = _tasks(t, target(record)["run_dir"], lines)
    return {str((v["task"] or {}).get("node") or f"task-{i}"): "\n".join(v["log"]) + "\n"
            for i, v in sorted(tasks.items())}


def collect(record: runs.RunRecord, checkpoints: bool = False,
            on_bytes: Callable[[str, int], None] | None = None) -> dict[str, run_collect.NodeCollect]:
    """Each task's folder into runs/<id>/<node>/ (as an SSH node's run folder), verified; the job's own
    files (batch script, batch log, settings) into runs/<id>/slurm/."""
    assert record.target is not None
    record = refresh(record) if record.active else record
    base = runs.run_path(record.run_id)
    host = _agent_host(record)
    out: dict[str, run_collect.NodeCollect] = {}
    with transport_for(host) as t:
        for n in record.nodes:
            def cb(k: int, name: str = n.node) -> None:
                if on_bytes is not None:
                    on_bytes(name, k)

            try:
                got = run_collect.collect_node(t, n.run_dir, run_collect.safe_dest(base, n.node), checkpoints, cb)
                got.node = n.node  # the task's node, not the login node it was read through
                # the task's program/ is a link to the run's one program (staged from the head): not a result
                got.skipped = [x for x in got.skipped if x.get("path") != "program"]
                out[n.node] = got
            except ClusterError as e:
                res = run_collect.NodeCollect(n.node)
                res.status, res.error, res.fix = "failed", e.message, e.fix
                out[n.node] = res
        rdir = target(record)["run_dir"]
        (base / "slurm").mkdir(parents=True, exist_ok=True)
        for name in (layout.BATCH_SCRIPT, layout.SETTINGS, layout.BATCH_LOG):
            r = t.run(f"cat -- {shlex.quote(rdir + '/' + name)} 2>/dev/null", timeout=120)
            if r.exit_code == 0:
                (base / "slurm" / name).write_text(r.stdout)
    runs.update(record.run_id, lambda r: setattr(r, "collected", {
        "time": time.time(), "nodes": {k: v.to_dict() for k, v in out.items()}}))
    return out
