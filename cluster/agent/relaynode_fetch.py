"""clusterctl's relay on a node, receiving side: `fetch` files from peers' relays, piece by piece, each piece
checked against the head's sha256 before it is written. Standard library only; uploaded beside
relaynode.py, the entry point (its docstring has the protocol)."""
from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import IO, TYPE_CHECKING, Any, Dict, List

if TYPE_CHECKING or __package__:  # in the package (tests, type checks)
    from cluster.agent.relaynode_common import NAME_RE, Doc, part_path, record_verified, reply
else:  # on the node: the head uploads the parts side by side
    from relaynode_common import NAME_RE, Doc, part_path, record_verified, reply


class SourceFailed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind  # lost | stall | refused | corrupt


def verified_prefix(part: str, piece: int, pieces: List[str], size: int) -> int:
    """Bytes of `.part` that match the manifest's pieces; the rest is cut."""
    good = 0
    try:
        f = open(part, "r+b")
    except FileNotFoundError:
        return 0
    with f:
        for i, want in enumerate(pieces):
            n = min(piece, size - i * piece)
            block = f.read(n)
            if len(block) != n or hashlib.sha256(block).hexdigest() != want:
                break
            good += n
        f.truncate(good)
    return good


def recv_exact(conn: socket.socket, n: int, buf: bytearray) -> None:
    view = memoryview(buf)[:n]
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)  # bounded: the socket's timeout (stall)
        if k == 0:
            raise SourceFailed("lost", "closed the connection after %d of %d bytes of a piece" % (got, n))
        got += k


def _connect(src: List[Any], req: Doc) -> socket.socket:
    try:
        return socket.create_connection((str(src[0]), int(src[1])), timeout=float(req.get("connect_s", 5)))
    except socket.timeout:
        raise SourceFailed("stall", "no answer within %ss" % req.get("connect_s", 5)) from None
    except OSError as e:
        raise SourceFailed("lost", "cannot connect: %s" % e) from None


def _ask(conn: socket.socket, req: Doc, offset: int) -> None:
    """The request for [offset, size) of the file, and the relay's "OK" (anything else refuses)."""
    conn.sendall((json.dumps({"token": req["token"], "name": req["name"], "offset": offset,
                              "size": int(req["size"])}) + "\n").encode())
    head = b""
    while not head.endswith(b"\n"):
        b = conn.recv(1)  # bounded: the socket's timeout (stall)
        if not b:
            raise SourceFailed("lost", "closed the connection before answering")
        head += b
        if len(head) > 256:
            raise SourceFailed("refused", "an answer that is not the relay's")
    if head != b"OK\n":
        raise SourceFailed("refused", head.decode(errors="replace").strip())


def _pieces(conn: socket.socket, req: Doc, out: IO[bytes], offset: int, stats: Dict[str, int]) -> int:
    """Pieces until the end of the file, each checked before it is written; returns the new length."""
    size, piece, pieces = int(req["size"]), int(req["piece"]), req["pieces"]
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
        out.flush()  # the .part is the node's progress counter: the head polls its size
        offset += n
        stats["received"] += n
    return offset


def fetch_from(src: List[Any], req: Doc, out: IO[bytes], offset: int, stats: Dict[str, int]) -> int:
    """Pieces from one source, each checked before it is written. Returns the new verified length."""
    stall = float(req.get("stall_s", 30))
    conn = _connect(src, req)
    try:
        conn.settimeout(stall)  # every recv below: at most `stall` s without a byte
        _ask(conn, req, offset)
        return _pieces(conn, req, out, offset, stats)
    except socket.timeout:
        raise SourceFailed("stall", "no byte for %gs after %d of %d bytes"
                           % (stall, os.fstat(out.fileno()).st_size, int(req["size"]))) from None
    except OSError as e:
        raise SourceFailed("lost", "%s after %d of %d bytes"
                           % (e, os.fstat(out.fileno()).st_size, int(req["size"]))) from None
    finally:
        conn.close()


def fetch_one(req: Doc, f: Doc, gone: Dict[str, Doc]) -> Doc:
    """One file from the first of its sources that can finish it; `gone` collects sources that failed
    as a whole (lost, stalled, refused), which the later files of this request skip."""
    d, name = str(req["dir"]), str(f["name"])
    size, piece, pieces = int(f["size"]), int(req["piece"]), f["pieces"]
    if not NAME_RE.match(name) or piece <= 0 or len(pieces) != -(-size // piece):
        return {"ok": False, "error": "bad request", "received": 0, "resumed_from": 0, "failed": {}}
    part = part_path(d, name)
    offset = verified_prefix(part, piece, pieces, size)
    stats = {"received": 0, "refused_pieces": 0, "resumed_from": offset}
    failed: Dict[str, Doc] = {}
    source = None
    job = dict(req, name=name, size=size, pieces=pieces)
    with open(part, "ab") as out:
        for src in f["sources"]:
            key = "%s:%s" % (src[0], src[1])
            if offset >= size:
                break
            if key in gone:
                continue
            try:
                offset = fetch_from(src, job, out, offset, stats)
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
    # every piece matched, and the head made the piece list in the same pass that checked the file against
    # the manifest's sha256 (relay/routes.py items): the file is the manifest's, without hashing it twice here
    os.replace(part, os.path.join(d, name))
    record_verified(d, {name: str(f["sha256"])})
    return dict(done, ok=True)


def cmd_fetch(req: Doc) -> int:
    """Each file of the request in order, each from its own list of sources (nearest first)."""
    os.makedirs(str(req["dir"]), exist_ok=True)
    gone: Dict[str, Doc] = {}
    results = {}
    for f in req["files"]:
        results[str(f["name"])] = fetch_one(req, f, gone)
    ok = all(r["ok"] for r in results.values())
    reply({"ok": ok, "files": results})
    return 0 if ok else 3
