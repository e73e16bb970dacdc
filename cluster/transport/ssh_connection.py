"""One SSH connection to a node through paramiko: identity, host key policy, connect errors that say what to do.

Host keys are verified against the inventory's known_hosts and never accepted unasked. The connection is
kept for the invocation; a stalled or broken one is dropped whole and the next call reconnects.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import paramiko

from cluster.errors import TransportError
from cluster.transport.base import Transport
from cluster.transport.route import Route, connect_error, load_key, open_route, trust_known_hosts

KEEPALIVE_S = 15
_WATCH_POLL_S = 0.25  # how often a watchdog looks at its limit (the limit may move: a copy's progress)
# paramiko logs failed handshakes from its own threads; we report them as results instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class SSHConnection(Transport):
    """The connection itself; commands (cluster.transport.ssh) and copies (cluster.transport.sftp) build on it."""

    _client: paramiko.SSHClient | None = None
    _sftp: paramiko.SFTPClient | None = None
    _route: Route | None = None  # the jump hosts' connections under it, closed with it

    def connect(self) -> None:
        if self._client is not None:
            return
        h = self.host
        client = paramiko.SSHClient()
        trust_known_hosts(client, h)
        key = load_key(h.key_path) if h.key_path else None
        start = time.monotonic()
        route = None
        try:
            route = open_route(h)  # TCP, the host's ProxyCommand, or a channel through its jump hosts
            client.connect(
                hostname=h.address, port=h.port, username=h.user, pkey=key, sock=route.sock,
                timeout=h.connect_timeout, banner_timeout=h.connect_timeout, auth_timeout=h.connect_timeout,
                look_for_keys=key is None, allow_agent=key is None,
            )
        except BaseException as e:
            client.close()
            if route is not None:
                route.close()
            if isinstance(e, TransportError):  # a hop's own, or our host-key policy's
                raise
            raise connect_error(h, e, time.monotonic() - start) from None
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(KEEPALIVE_S)
        self._client, self._route = client, route

    @property
    def peer_address(self) -> str | None:
        """The address the node was reached at: the socket's peer, or (through jump hosts or a ProxyCommand,
        whose socket ends elsewhere) the address the last hop dialed, when it is an IP address."""
        if self._route is not None and (self._route.hops or self.host.proxy_command):
            import ipaddress

            try:
                return str(ipaddress.ip_address(self.host.address))
            except ValueError:
                return None
        t = self._client.get_transport() if self._client else None
        return t.getpeername()[0] if t else None

    def _live_transport(self) -> paramiko.Transport:
        """The connection's transport, reconnecting once if it died since the last call."""
        self.connect()
        assert self._client is not None
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            self._abort()
            self.connect()
            assert self._client is not None
            transport = self._client.get_transport()
            if transport is None or not transport.is_active():
                raise TransportError(f"{self.host.name}: connection lost", "check the node and the network",
                                     "unreachable")
        return transport

    def _abort(self) -> None:
        """Drop the whole connection after a stalled or broken transfer: a half-read SFTP stream cannot be
        reused, and a node that stopped answering one channel is suspect. The next call reconnects."""
        client, self._client, self._sftp = self._client, None, None
        if client is not None:
            client.close()  # closes the socket first, so nothing waits on the silent peer
        self._close_route()

    def _close_route(self) -> None:
        route, self._route = self._route, None
        if route is not None:
            route.close()

    def _bounded_request(self, chan: paramiko.Channel, request: Callable[[], None], bound: float) -> None:
        """A channel request (exec, subsystem): paramiko waits for its reply without a limit, so a timer
        closes the channel after `bound` s, which wakes the wait; reported as socket.timeout."""
        fired = threading.Event()

        def fire() -> None:
            fired.set()
            try:
                chan.close()
            except Exception:  # noqa: BLE001 - a timer thread must not print a traceback
                pass

        timer = threading.Timer(bound, fire)
        timer.daemon = True
        timer.start()
        try:
            request()
        except (paramiko.SSHException, EOFError, OSError):
            if fired.is_set():
                raise socket.timeout(f"no reply within {bound:g}s") from None
            raise
        finally:
            timer.cancel()
        if fired.is_set():
            raise socket.timeout(f"no reply within {bound:g}s")

    @contextmanager
    def _watchdog(self, left: Callable[[], float], name: str) -> Iterator[threading.Event]:
        """A thread that closes the connection under the caller once `left()` (seconds to the limit, read
        again at each look) reaches 0; yields the event it sets when it fired.

        NOTE: the one wait paramiko cannot bound: Packetizer.write_all retries a write the kernel will not
        take forever (a frozen node whose TCP buffers filled before the SSH window did). A channel timeout
        does not reach it; only a closed socket ends it. Copies (sftp.py) and commands (ssh.py) share this."""
        stop, fired = threading.Event(), threading.Event()

        def watch() -> None:
            while (remaining := left()) > 0:
                if stop.wait(min(remaining, _WATCH_POLL_S)):
                    return
            if not stop.is_set():
                fired.set()
                self._abort()  # the socket closes: a write paramiko retries forever fails now

        threading.Thread(target=watch, name=name, daemon=True).start()
        try:
            yield fired
        finally:
            stop.set()

    def close(self) -> None:
        """Drop the connection. The SFTP channel is not closed politely first: that sends a message, and a
        send waits without a limit on a node that stopped reading; closing the socket ends its session too."""
        self._sftp = None
        client, self._client = self._client, None
        if client is not None:
            client.close()
        self._close_route()
