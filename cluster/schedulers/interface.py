"""The interface every run target implements, after torchx's `Scheduler` (torchx/schedulers/api.py):
dry-run builds the request and prints it (`submit_dryrun`), submit runs exactly that request (`schedule`),
then describe, logs (and their follow), stop, collect.

A run record names its scheduler (`RunRecord.scheduler`); `api.of(record)` gives it back, so nothing above this
package asks which target a run has. A scheduler declares the launch options that are its own (Slurm's
partition, time, ...) and the common ones it cannot honour, with why: the CLI builds its flags and its
refusals from those declarations.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

if TYPE_CHECKING:
    from cluster.inventory.model import Host, Inventory
    from cluster.runs.collect import NodeCollect
    from cluster.runs.jobs import JobSpec
    from cluster.runs.records import RunRecord

Log = Callable[[str], None]
OnUpdate = Callable[["RunRecord", Any], None]  # (record, the scheduler's latest per-node view)


@dataclass(frozen=True)
class Option:
    """A launch option that is one scheduler's own (`--partition P`): argparse's dest, help and value kind
    (text; positive: a whole number > 0; count: a whole number >= 0), which the CLI turns into its type."""

    name: str
    help: str
    metavar: str
    kind: str = "text"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass
class Submission:
    """What a launch asks, before any scheduler has looked at it: the job, the inventory, where (`on`: a
    cluster of the inventory, None for its PCs) and the options of the command line (name -> value, None
    where not given)."""

    inventory: Inventory
    spec: JobSpec
    on: str | None = None
    limit: str | None = None
    forks: int = 32
    options: dict[str, Any] = field(default_factory=dict)
    nodes: int | None = None  # how many nodes (the study's node counts): the first N PCs, or N of the cluster
    outside_slurm: bool = False  # the admin's --outside-slurm: the inventory's PCs even where a room's Slurm holds them


class Logs(dict[str, str]):
    """node -> its log (the last lines); `unreachable`: the nodes that could not be read (their text says why)."""

    def __init__(self, texts: dict[str, str], unreachable: set[str] | None = None) -> None:
        super().__init__(texts)
        self.unreachable = set(unreachable or ())


class Request(Protocol):
    """A scheduler's request: what `--dry-run` prints, and exactly what `submit` runs."""

    run_id: str

    def to_dict(self) -> dict[str, Any]: ...
    def to_text(self, width: int = 100) -> str: ...


class Scheduler(Protocol):
    name: str  # what a run record says (`RunRecord.scheduler`)
    title: str  # for --help's group of its options
    options: tuple[Option, ...]  # launch options of its own
    refuses: dict[str, str]  # common launch options it cannot honour (argparse dest -> why)
    continues_runs: bool  # `launch --continue RUN` can take one of its runs further

    def pcs(self, sub: Submission) -> list[Host] | None: ...  # the inventory's PCs the job runs on (None: it picks)
    def dryrun(self, sub: Submission, log: Log = lambda s: None) -> Request: ...
    def submit(self, request: Any, log: Log = lambda s: None, prediction: dict[str, Any] | None = None,
               watch: bool = True, forks: int = 32) -> RunRecord: ...
    def describe(self, record: RunRecord) -> RunRecord: ...
    def follow(self, record: RunRecord, on_update: OnUpdate | None = None) -> RunRecord: ...
    def logs(self, record: RunRecord, node: str | None = None, lines: int = 50) -> Logs: ...
    def log_iter(self, record: RunRecord, node: str | None = None,
                 unreachable: set[str] | None = None) -> Iterator[tuple[str, str]]: ...
    def stop(self, record: RunRecord, grace: float = 10.0) -> RunRecord: ...
    def collect(self, record: RunRecord, checkpoints: bool = False, forks: int = 32,
                on_bytes: Callable[[str, int], None] | None = None,
                inventory_hosts: dict[str, Host] | None = None) -> dict[str, NodeCollect]: ...
    def where(self, record: RunRecord) -> str: ...
    def details(self, record: RunRecord) -> list[str]: ...


