"""clusterctl's relay on a node, serving side: `serve` (a detached server) and `stop`. Standard library only;
uploaded beside relaynode.py, the entry point (its docstring has the protocol and the safety rules)."""
from __future__ import annotations

import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Optional

if TYPE_CHECKING or __package__:  # in the package (tests, type checks)
    from cluster.agent.relaynode_common import NAME_RE, REQUEST_MAX, Doc, part_path, reply
else:  # on the node: the head uploads the parts side by side
    from relaynode_common import NAME_RE, REQUEST_MAX, Doc, part_path, reply


class Server:
    def __init__(self, cfg: Doc, sock: socket.socket) -> None:
        self.cfg = cfg
        self.sock = sock
        self.token = str(cfg["token"]).encode()
        self.root = os.path.realpath(cfg["root"])
        self.allow = set(cfg.get("allow") or [])
        self.stall = float(cfg.get("stall_s", 30))
        self.idle = float(cfg.get("idle_s", 120))
        self.deadline = time.monotonic() + float(cfg.get("max_s", 6 * 3600))
        self.pidfile: Optional[str] = cfg.get("pidfile")
        self.active = 0
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def should_stop(self) -> bool:
        now = time.monotonic()
        if now > self.deadline:
            return True
        if self.pidfile and not os.path.exists(self.pidfile):
            return True  # the head removed it: the run is over
        with self.lock:
            return self.active == 0 and now - self.last > self.idle

    def loop(self) -> None:
        self.sock.settimeout(1.0)  # wake every second to check the stop conditions
        while not self.should_stop():
            try:
                conn, addr = self.sock.accept()  # bounded: settimeout(1.0) above
            except socket.timeout:
                continue
            except OSError:
                break
            if self.allow and addr[0] not in self.allow:
                conn.close()
                continue
            with self.lock:
                self.active += 1
                self.last = time.monotonic()
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()
        self.sock.close()

    def handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.stall)  # every recv and send below: at most `stall` s without progress
            self.serve_one(conn)
        except (OSError, ValueError):
            pass
        finally:
            conn.close()
            with self.lock:
                self.active -= 1
                self.last = time.monotonic()

    def serve_one(self, conn: socket.socket) -> None:
        buf = b""
        while b"\n" not in buf:
            got = conn.recv(4096)  # bounded: settimeout(stall)
            if not got or len(buf) > REQUEST_MAX:
                return
            buf += got
        req = json.loads(buf.split(b"\n", 1)[0].decode())
        if not hmac.compare_digest(str(req.get("token", "")).encode(), self.token):
            conn.sendall(b"ERR token\n")
            return
        name = str(req.get("name", ""))
        offset, size = int(req.get("offset", 0)), int(req.get("size", 0))
        if not NAME_RE.match(name) or not 0 <= offset <= size:
            conn.sendall(b"ERR request\n")
            return
        f = self.open_growing(name)
        if f is None:
            conn.sendall(b"ERR missing\n")
            return
        with f:
            conn.sendall(b"OK\n")
            self.stream(conn, f, offset, size)

    def open_growing(self, name: str) -> Optional[IO[bytes]]:
        """The complete file, else the `.part` another copy is filling, waiting up to `stall` s for either."""
        final, part = os.path.join(self.root, name), part_path(self.root, name)
        end = time.monotonic() + self.stall
        while True:
            for p in (final, part, final):  # the .part may be renamed between the two looks
                try:
                    return open(p, "rb")
                except FileNotFoundError:
                    continue
            if time.monotonic() > end:
                return None
            time.sleep(0.05)

    def stream(self, conn: socket.socket, f: IO[bytes], offset: int, size: int) -> None:
        """Bytes [offset, size) of a file that may still be growing: what is there goes out at once
        (sendfile), then more as it arrives; `stall` s without growth ends the answer."""
        waited_since = time.monotonic()
        while offset < size:
            have = os.fstat(f.fileno()).st_size
            if have > offset:
                n = min(have, size) - offset
                sent = conn.sendfile(f, offset, n)  # bounded: the socket's timeout (stall)
                offset += sent
                waited_since = time.monotonic()
                with self.lock:
                    self.last = waited_since
                continue
            if time.monotonic() - waited_since > self.stall:
                return
            time.sleep(0.02)


def _answer_when_started(port: int, pidfile: Optional[str]) -> None:
    """The parent's side of the fork: answer the head once the detached server has written its pid."""
    pid = None
    for _ in range(300 if pidfile else 0):  # at most 3 s
        try:
            with open(str(pidfile)) as f:
                pid = int(f.read().strip())
            break
        except (OSError, ValueError):
            time.sleep(0.01)
    reply({"ok": pid is not None or not pidfile, "port": port, "pid": pid})


def _detach(pidfile: Optional[str]) -> None:
    """The server's side: a new session, no terminal, stdio on /dev/null, its pid recorded."""
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    if pidfile:
        tmp = pidfile + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, pidfile)
    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _forget_pidfile(pidfile: Optional[str]) -> None:
    if pidfile:
        try:
            with open(pidfile) as f:
                if f.read().strip() == str(os.getpid()):
                    os.unlink(pidfile)
        except OSError:
            pass


def cmd_serve(cfg: Doc) -> None:
    bind = str(cfg["bind"])
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((bind, int(cfg.get("port", 0))))
    sock.listen(64)
    port = sock.getsockname()[1]
    pidfile: Optional[str] = cfg.get("pidfile")
    sys.stdout.flush()
    if os.fork() > 0:  # the head's command returns; the server lives on, detached from the session
        _answer_when_started(port, pidfile)
        os._exit(0)
    _detach(pidfile)
    try:
        Server(cfg, sock).loop()
    finally:
        _forget_pidfile(pidfile)
    os._exit(0)


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited server waits for its adoptive parent to reap it)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _ours(pid: int) -> bool:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return b"relaynode.py" in f.read()
    except OSError:
        return False


def cmd_stop(cfg: Doc) -> None:
    """End the server named by the pidfile (only if that pid is still our server), at most 5 s."""
    pidfile = str(cfg["pidfile"])
    try:
        with open(pidfile) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        reply({"ok": True, "stopped": None})
        return
    os.unlink(pidfile)  # the server also exits by itself within a second when this is gone
    ours = _ours(pid)
    if ours:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        end = time.monotonic() + 5
        while time.monotonic() < end and running(pid):
            time.sleep(0.02)
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    reply({"ok": True, "stopped": pid if ours else None})
