"""clusterctl's peer relay on a node: serve the files this node holds to the other nodes of the run, fetch
files from them, and commit files the head sent. Standard library only: run by the node's system python.

The head uploads this file for one distribution (provision's wheels, launch's dataset) and drives it:

    python3 relaynode.py serve   < {"token", "bind", "root", "allow", "stall_s", "idle_s", "max_s", "pidfile"}
    python3 relaynode.py fetch   < {"token", "dir", "piece", "stall_s", "connect_s",
                                    "files": [{"name", "size", "sha256", "pieces", "sources"}, ...]}
    python3 relaynode.py commit  < {"dir", "files": {name: sha256}}
    python3 relaynode.py adopt   < {"dir", "files": {name: sha256}}
    python3 relaynode.py stop    < {"pidfile"}

Each prints one JSON object on its last line. Why it is safe to leave to a node:
- `serve` listens on the node's inventory address only, answers only the addresses of this inventory's
  nodes that know this run's random token, serves only plain file names inside one directory, reads with a
  timeout on every socket, and exits by itself when idle for idle_s, after max_s in all, or when its
  pidfile is removed (the head stops it at the end of the run in any case).
- `fetch` writes a piece into `.NAME.part` only after its sha256 matched the head's manifest, so a
  `.part` is always a verified prefix: another node may relay it while it grows, and a fetch cut short
  resumes after its last verified piece. The whole file's sha256 is checked before it gets its name.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import signal
import socket
import sys
import threading
import time

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,254}$")
MANIFEST = ".clusterctl-manifest.json"
REQUEST_MAX = 65536
CHUNK = 1 << 20


def reply(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def read_request() -> dict:
    return json.loads(sys.stdin.read() or "{}")


def part_path(d: str, name: str) -> str:
    return os.path.join(d, "." + name + ".part")


# --------------------------------------------------------------------------- manifest (the node's verified files)


def load_manifest(d: str) -> dict:
    try:
        with open(os.path.join(d, MANIFEST)) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def record_verified(d: str, entries: dict) -> None:
    """Add {name: sha256} to the node's manifest: written aside, then renamed (never half a manifest)."""
    doc = load_manifest(d)
    doc.update(entries)
    tmp = os.path.join(d, ".%s.%d.tmp" % (MANIFEST, os.getpid()))
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, MANIFEST))


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


# --------------------------------------------------------------------------- serve


class Server:
    def __init__(self, cfg: dict, sock: socket.socket) -> None:
        self.cfg = cfg
        self.sock = sock
        self.token = str(cfg["token"]).encode()
        self.root = os.path.realpath(cfg["root"])
        self.allow = set(cfg.get("allow") or [])
        self.stall = float(cfg.get("stall_s", 30))
        self.idle = float(cfg.get("idle_s", 120))
        self.deadline = time.monotonic() + float(cfg.get("max_s", 6 * 3600))
        self.pidfile = cfg.get("pidfile")
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

    def open_growing(self, name: str):
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

    def stream(self, conn: socket.socket, f, offset: int, size: int) -> None:
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


def cmd_serve(cfg: dict) -> None:
    bind = str(cfg["bind"])
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((bind, int(cfg.get("port", 0))))
    sock.listen(64)
    port = sock.getsockname()[1]
    pidfile = cfg.get("pidfile")
    sys.stdout.flush()
    if os.fork() > 0:  # the head's command returns; the server lives on, detached from the session
        # the parent answers once the detached server has written its pid
        pid = None
        for _ in range(300):  # at most 3 s
            try:
                pid = int(open(pidfile).read().strip()) if pidfile else None
                break
            except (OSError, ValueError):
                time.sleep(0.01)
        reply({"ok": pid is not None or not pidfile, "port": port, "pid": pid})
        os._exit(0)
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
    try:
        Server(cfg, sock).loop()
    finally:
        if pidfile:
            try:
                if open(pidfile).read().strip() == str(os.getpid()):
                    os.unlink(pidfile)
            except OSError:
                pass
    os._exit(0)


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited server waits for its adoptive parent to reap it)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cmd_stop(cfg: dict) -> None:
    """End the server named by the pidfile (only if that pid is still our server), at most 5 s."""
    pidfile = str(cfg["pidfile"])
    try:
        pid = int(open(pidfile).read().strip())
    except (OSError, ValueError):
        reply({"ok": True, "stopped": None})
        return
    os.unlink(pidfile)  # the server also exits by itself within a second when this is gone
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            ours = b"relaynode.py" in f.read()
    except OSError:
        ours = False
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


# --------------------------------------------------------------------------- fetch, commit, adopt


class SourceFailed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind  # lost | stall | refused | corrupt


def verified_prefix(part: str, piece: int, pieces: list, size: int):
    """(bytes of `.part` that match the manifest's pieces, the sha256 object over them); the rest is cut."""
    h = hashlib.sha256()
    good = 0
    try:
        f = open(part, "r+b")
    except FileNotFoundError:
        return 0, h
    with f:
        for i, want in enumerate(pieces):
            n = min(piece, size - i * piece)
            block = f.read(n)
            if len(block) != n or hashlib.sha256(block).hexdigest() != want:
                break
            h.update(block)
            good += n
        f.truncate(good)
    return good, h


def recv_exact(conn: socket.socket, n: int, buf: bytearray) -> None:
    view = memoryview(buf)[:n]
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)  # bounded: the socket's timeout (stall)
        if k == 0:
            raise SourceFailed("lost", "closed the connection after %d of %d bytes of a piece" % (got, n))
        got += k


def fetch_from(src: list, req: dict, out, offset: int, whole, stats: dict) -> int:
    """Pieces from one source, each checked before it is written. Returns the new verified length."""
    host, port = str(src[0]), int(src[1])
    size, piece, pieces = int(req["size"]), int(req["piece"]), req["pieces"]
    stall = float(req.get("stall_s", 30))
    try:
        conn = socket.create_connection((host, port), timeout=float(req.get("connect_s", 5)))
    except socket.timeout:
        raise SourceFailed("stall", "no answer within %ss" % req.get("connect_s", 5))
    except OSError as e:
        raise SourceFailed("lost", "cannot connect: %s" % e)
    try:
        conn.settimeout(stall)  # every recv below: at most `stall` s without a byte
        conn.sendall((json.dumps({"token": req["token"], "name": req["name"], "offset": offset,
                                  "size": size}) + "\n").encode())
        head = b""
        while not head.endswith(b"\n"):
            b = conn.recv(1)  # bounded: settimeout(stall)
            if not b:
                raise SourceFailed("lost", "closed the connection before answering")
            head += b
            if len(head) > 256:
                raise SourceFailed("refused", "an answer that is not the relay's")
        if head != b"OK\n":
            raise SourceFailed("refused", head.decode(errors="replace").strip())
        buf = bytearray(piece)
        while offset < size:
            i = offset // piece
            n = min(piece, size - offset)
            recv_exact(conn, n, buf)
            block = memoryview(buf)[:n]
            if hashlib.sha256(block).hexdigest() != pieces[i]:
                stats["refused_pieces"] += 1
                raise SourceFailed("corrupt", "piece %d (bytes %d-%d) does not match the head's sha256"
                                   % (i, offset, offset + n))
            out.write(block)
            out.flush()
            whole.update(block)
            offset += n
            stats["received"] += n
        return offset
    except socket.timeout:
        raise SourceFailed("stall", "no byte for %gs after %d of %d bytes" % (stall, offset, size))
    except SourceFailed:
        raise
    except OSError as e:
        raise SourceFailed("lost", "%s after %d of %d bytes" % (e, offset, size))
    finally:
        conn.close()


def fetch_one(req: dict, f: dict, gone: dict) -> dict:
    """One file from the first of its sources that can finish it; `gone` collects sources that failed
    as a whole (lost, stalled, refused), which the later files of this request skip."""
    d, name = str(req["dir"]), str(f["name"])
    size, piece, pieces = int(f["size"]), int(req["piece"]), f["pieces"]
    if not NAME_RE.match(name) or piece <= 0 or len(pieces) != -(-size // piece):
        return {"ok": False, "error": "bad request", "received": 0, "resumed_from": 0, "failed": {}}
    part = part_path(d, name)
    offset, whole = verified_prefix(part, piece, pieces, size)
    stats = {"received": 0, "refused_pieces": 0, "resumed_from": offset}
    failed = {}
    source = None
    job = dict(req, name=name, size=size, pieces=pieces)
    with open(part, "ab") as out:
        for src in f["sources"]:
            if offset >= size:
                break
            key = "%s:%s" % (src[0], src[1])
            if key in gone:
                continue
            try:
                offset = fetch_from(src, job, out, offset, whole, stats)
                source = key
            except SourceFailed as e:
                failed[key] = {"kind": e.kind, "detail": str(e)}
                if e.kind != "corrupt":
                    gone[key] = failed[key]
                out.flush()
                offset = os.fstat(out.fileno()).st_size  # only verified pieces were written
    done = {"received": stats["received"], "resumed_from": stats["resumed_from"], "source": source,
            "failed": failed, "refused_pieces": stats["refused_pieces"], "have": offset}
    if offset < size:
        return dict(done, ok=False, error="no source could finish the file")
    if whole.hexdigest() != f["sha256"]:  # every piece matched, so only a wrong manifest gets here
        os.unlink(part)
        return dict(done, ok=False, error="whole-file sha256 differs from the manifest (removed)")
    os.replace(part, os.path.join(d, name))
    record_verified(d, {name: f["sha256"]})
    return dict(done, ok=True)


def cmd_fetch(req: dict) -> int:
    """Each file of the request in order, each from its own list of sources (nearest first)."""
    os.makedirs(str(req["dir"]), exist_ok=True)
    gone = {}
    results = {}
    for f in req["files"]:
        results[str(f["name"])] = fetch_one(req, f, gone)
    ok = all(r["ok"] for r in results.values())
    reply({"ok": ok, "files": results})
    return 0 if ok else 3


def cmd_commit(req: dict) -> int:
    """Files the head sent into `.NAME.part`: each checked against the manifest, then named and recorded;
    one that differs is removed (it is sent again)."""
    d = str(req["dir"])
    results = {}
    for name, want in req["files"].items():
        part = part_path(d, name)
        if not NAME_RE.match(name):
            results[name] = {"ok": False, "error": "not a plain file name"}
            continue
        try:
            got = sha256_of(part)
        except OSError as e:
            results[name] = {"ok": False, "error": str(e)}
            continue
        if got != want:
            os.unlink(part)
            results[name] = {"ok": False, "error": "sha256 %s, the manifest says %s (removed)" % (got, want)}
            continue
        os.replace(part, os.path.join(d, name))
        results[name] = {"ok": True}
    good = {n: req["files"][n] for n, r in results.items() if r["ok"]}
    if good:
        record_verified(d, good)
    ok = all(r["ok"] for r in results.values())
    reply({"ok": ok, "files": results})
    return 0 if ok else 4


def cmd_adopt(req: dict) -> int:
    """Files already here at the right size but never verified (an interrupted run, an older clusterctl):
    hashed, and recorded when they match; the others are left to be fetched again. With "drop_bad" (a
    file another node refused when this one served it), a file that does not match is removed and
    forgotten by the manifest, so it is fetched again."""
    d = str(req["dir"])
    good, bad = {}, []
    for name, want in req["files"].items():
        if not NAME_RE.match(name):
            continue
        try:
            ok = sha256_of(os.path.join(d, name)) == want
        except OSError:
            ok = False
        if ok:
            good[name] = want
        else:
            bad.append(name)
    if req.get("drop_bad") and bad:
        for name in bad:
            try:
                os.unlink(os.path.join(d, name))
            except OSError:
                pass
        doc = load_manifest(d)
        for name in bad:
            doc.pop(name, None)
        with open(os.path.join(d, MANIFEST + ".tmp"), "w") as f:
            json.dump(doc, f, indent=0)
        os.replace(os.path.join(d, MANIFEST + ".tmp"), os.path.join(d, MANIFEST))
    if good:
        record_verified(d, good)
    reply({"ok": True, "verified": sorted(good), "bad": sorted(bad)})
    return 0


def main(argv: list) -> int:
    if len(argv) != 2 or argv[1] not in ("serve", "fetch", "commit", "adopt", "stop"):
        sys.stderr.write("usage: relaynode.py serve|fetch|commit|adopt|stop < request.json\n")
        return 2
    req = read_request()
    if argv[1] == "serve":
        cmd_serve(req)
        return 0
    if argv[1] == "stop":
        cmd_stop(req)
        return 0
    return {"fetch": cmd_fetch, "commit": cmd_commit, "adopt": cmd_adopt}[argv[1]](req)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
