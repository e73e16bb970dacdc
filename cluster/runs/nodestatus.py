"""What a node's agent says of its part of a run: one bounded `status` call per node, read as data from the
node (a reply of the wrong types is `unanswered`, never a crash), one NodeStatus each."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.nodes.fanout import Group
from cluster.nodes.replies import agent_reply, error_tail
from cluster.runs import records, render

POLL_TIMEOUT_S = 20.0  # one agent `status` call
FAILED_STATES = ("failed", "vanished", "missing")  # as the node's agent reports them: final at once
SILENT_STATES = ("unreachable", "unanswered")  # no (readable) answer: failed only after the grace
AGENT_STATES = ("not started", "running", "stopping", "succeeded", "failed", "stopped", "vanished", "missing")


def _obj(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _num(x: Any, kind: type = float) -> Any:
    """x when it is a number (a whole one for kind=int), else None: agent replies are data from a node."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or (kind is int and not isinstance(x, int)):
        return None
    return x


@dataclass
class NodeStatus:
    node: str
    state: str  # agent state, or unreachable
    epoch: int | None = None
    step: int | None = None
    loss: float | None = None
    images_per_s: float | None = None
    world: int | None = None
    ranks: int = 0
    exit_code: int | None = None
    processes: int = 0
    log: list[str] = field(default_factory=list)
    error: str | None = None
    ended: float | None = None
    cpu_percent: float | None = None  # the run's processes on this node, last sample (100: one core busy)
    rss_mb: float | None = None
    traceback: list[str] = field(default_factory=list)  # a failed program's last Python traceback
    failed_ranks: list[int] = field(default_factory=list)  # the global ranks torchrun's summary names
    # from its programs' start record: the membership period (cluster/runs/elastic.py) and where they resumed
    period: int | None = None
    start_epoch: int | None = None
    start_step: int | None = None
    user_metrics: dict[str, float] = field(default_factory=dict)  # $CLUSTER_METRICS: each field's newest number

    @classmethod
    def from_agent(cls, node: str, doc: dict[str, Any]) -> NodeStatus:
        """The agent's JSON, read defensively: a field of the wrong type is dropped, an unknown state is
        `unanswered` (the grace applies), never an exception."""
        state = doc.get("state")
        if state not in AGENT_STATES:
            return cls(node, "unanswered", error=f"unreadable agent reply (state {str(state)[:40]!r})")
        log = doc.get("log")
        exit_doc, metrics = _obj(doc.get("exit")), _obj(doc.get("metrics"))
        s = cls(node, state, error=doc.get("error") if isinstance(doc.get("error"), str) else None,
                log=[x for x in log if isinstance(x, str)] if isinstance(log, list) else [],
                traceback=[x for x in doc["traceback"] if isinstance(x, str)] if isinstance(doc.get("traceback"), list)
                else [],
                failed_ranks=[x for x in doc["failed_ranks"] if isinstance(x, int) and not isinstance(x, bool)]
                if isinstance(doc.get("failed_ranks"), list) else [],
                processes=len(doc["processes"]) if isinstance(doc.get("processes"), list) else 0,
                exit_code=_num(exit_doc.get("code"), int), ended=_num(exit_doc.get("ended")))
        usage = _obj(doc.get("usage"))
        s.cpu_percent, s.rss_mb = _num(usage.get("cpu_percent")), _num(usage.get("rss_mb"))
        ranks = {int(k): _obj(v) for k, v in metrics.items() if isinstance(k, str) and k.isascii() and k.isdecimal()}
        s.ranks = len(ranks)
        if ranks:
            recs = ranks[min(ranks)]  # the node's lowest rank speaks for it
            last, end = _obj(recs.get("step")), _obj(recs.get("end"))
            start = _obj(recs.get("start"))
            s.world = _num(start.get("world"), int)
            s.period, s.start_epoch = _num(start.get("period", 1), int), _num(start.get("start_epoch"), int)
            s.start_step = _num(start.get("start_step"), int)
            s.epoch, s.step = _num(last.get("epoch"), int), _num(end.get("step", last.get("step")), int)
            s.loss, s.images_per_s = _num(last.get("loss")), _num(last.get("images_per_s"))
        s.user_metrics = {k: v for k, v in _obj(doc.get("user_metrics")).items() if _num(v) is not None}
        if not ranks:  # a user's own program: what it wrote to $CLUSTER_METRICS (docs/metrics.md)
            mine = s.user_metrics
            s.epoch, s.step = _num(mine.get("epoch"), int), _num(mine.get("step"), int)
            s.loss, s.images_per_s = _num(mine.get("loss")), _num(mine.get("images_per_s"))
        return s

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def poll(record: records.RunRecord, group: Group | None = None, lines: int = 20) -> dict[str, NodeStatus]:
    """Every node's state, read by its agent (one bounded command per node).

    A node that cannot be reached is `unreachable`; one whose agent does not answer in time or answers
    something unreadable is `unanswered`: both get a grace time before they fail the run (see judge)."""
    dirs = record.node_dirs()
    asked = set(record.members()) | set(record.stop_pending)  # a dropped node only while its stop is pending
    hosts = [h for h in record.hosts() if h.name in asked]

    def ask(g: Group) -> dict[str, NodeStatus]:
        res = g.run(lambda h: render.agent_command(h, "status", dirs[h.name], str(lines)), timeout=POLL_TIMEOUT_S,
                    hosts=hosts)
        out = {}
        for h in hosts:
            r = res[h.name]
            doc = agent_reply(r.stdout)
            if doc is not None and isinstance(doc.get("state"), str):
                out[h.name] = NodeStatus.from_agent(h.name, doc)
            else:
                out[h.name] = NodeStatus(h.name, "unreachable" if r.status == "unreachable" else "unanswered",
                                         error=r.error or error_tail(r.stderr) or "no answer")
        return out

    if group is not None:
        return ask(group)
    with Group(hosts) as g:
        return ask(g)
