"""Run on many nodes at once; every node gets a result, failures are data (never raised mid fan-out).

Like fabric's ThreadingGroup -> GroupResult: policy (abort, continue) is the caller's, applied after.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, TypeVar

from cluster.errors import CommandTimeout, TransportError
from cluster.inventory.model import Host
from cluster.transport import CommandResult, Transport, transport_for

OK, FAILED, UNREACHABLE = "ok", "failed", "unreachable"
DEFAULT_FORKS = 32
T = TypeVar("T")


@dataclass
class HostResult:
    host: str
    status: str  # ok | failed | unreachable
    duration: float
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    problem: str | None = None  # machine-readable: timeout, refused, auth, hostkey-unknown, command-timeout, ...
    fix: str | None = None
    value: Any = None  # what a `call` function returned

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("value")
        return d


class GroupResult(dict[str, HostResult]):
    """host name -> HostResult, in inventory order."""

    @property
    def succeeded(self) -> dict[str, HostResult]:
        return {k: r for k, r in self.items() if r.status == OK}

    @property
    def failed(self) -> dict[str, HostResult]:
        return {k: r for k, r in self.items() if r.status == FAILED}

    @property
    def unreachable(self) -> dict[str, HostResult]:
        return {k: r for k, r in self.items() if r.status == UNREACHABLE}

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.values())


class Group:
    """Nodes of one invocation: one connection per node, reused for every command.

    A node that could not be reached stays unreachable for the group's lifetime, so
    a dead PC costs one connect timeout per invocation, not one per command.
    """

    def __init__(self, hosts: Iterable[Host], forks: int = DEFAULT_FORKS,
                 factory: Callable[[Host], Transport] = transport_for) -> None:
        self.hosts = list(hosts)
        self.forks = max(1, forks)
        self.transports = {h.name: factory(h) for h in self.hosts}
        self._dead: dict[str, HostResult] = {}
        self._pool = ThreadPoolExecutor(max_workers=min(self.forks, max(len(self.hosts), 1)),
                                        thread_name_prefix="fanout")

    def call(self, fn: Callable[[Transport], T], hosts: Iterable[Host] | None = None,
             on_done: Callable[[HostResult], None] | None = None) -> GroupResult:
        """Run `fn(transport)` on every node at once; its return value lands in `.value`."""
        targets = list(hosts) if hosts is not None else self.hosts
        futures = {h.name: self._pool.submit(self._one, h, fn, on_done) for h in targets}
        # bounded: every wait inside fn has its own limit (connect, command, transfer stall; docs/reliability.md)
        return GroupResult((name, fut.result()) for name, fut in futures.items())  # bounded: see above

    def run(self, command: str | Callable[[Host], str], timeout: float | None = None,
            hosts: Iterable[Host] | None = None,
            on_done: Callable[[HostResult], None] | None = None) -> GroupResult:
        """A shell command on every node (a callable builds a per-node command)."""

        def fn(t: Transport) -> CommandResult:
            cmd = command(t.host) if callable(command) else command
            return t.run(cmd, timeout=timeout)

        return self.call(fn, hosts, on_done)

    def _one(self, host: Host, fn: Callable[[Transport], Any],
             on_done: Callable[[HostResult], None] | None) -> HostResult:
        if host.name in self._dead:
            result = self._dead[host.name]
        else:
            result = self._attempt(host, fn)
        if on_done is not None:
            on_done(result)
        return result

    def _attempt(self, host: Host, fn: Callable[[Transport], Any]) -> HostResult:
        start = time.monotonic()
        t = self.transports[host.name]
        try:
            t.connect()
        except TransportError as e:
            r = HostResult(host.name, UNREACHABLE, time.monotonic() - start, error=e.message,
                           problem=e.problem, fix=e.fix)
            self._dead[host.name] = r
            return r
        try:
            value = fn(t)
        except CommandTimeout as e:
            return HostResult(host.name, FAILED, time.monotonic() - start, error=e.message,
                              problem="command-timeout", fix="raise command_timeout or --timeout")
        except TransportError as e:
            return HostResult(host.name, UNREACHABLE, time.monotonic() - start, error=e.message,
                              problem=e.problem, fix=e.fix)
        except Exception as e:  # noqa: BLE001 - one node's surprise must not hide the others
            return HostResult(host.name, FAILED, time.monotonic() - start, error=f"{type(e).__name__}: {e}",
                              problem="error")
        duration = time.monotonic() - start
        code = getattr(value, "exit_code", 0)
        return HostResult(host.name, OK if code == 0 else FAILED, duration, exit_code=code,
                          stdout=getattr(value, "stdout", ""), stderr=getattr(value, "stderr", ""),
                          value=value)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self.transports.values():
            t.close()

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
