"""clusterctl's peer relay on a node: serve the files this node holds to the other nodes of the run, fetch
files from them, and commit files the head sent. Standard library only: run by the node's system python.

The head uploads this file and the parts it imports (relaynode_common.py, relaynode_serve.py,
relaynode_fetch.py, side by side) for one distribution (provision's wheels, launch's dataset) and drives it:

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
  resumes after its last verified piece. The file gets its name when every piece matched: the head made
  the piece list in the pass that checked the file against the manifest's sha256, so each byte is
  hashed once per node (hashing is most of a relay's CPU).
  The size of the `.part` is also the node's progress: the head polls it (cluster/relay/progress.py).
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Dict, List

if TYPE_CHECKING or __package__:  # in the package (tests, type checks)
    from cluster.agent.relaynode_common import (NAME_RE, Doc, load_manifest, part_path, read_request,
                                                    record_verified, reply, sha256_of, write_manifest)
    from cluster.agent.relaynode_fetch import cmd_fetch
    from cluster.agent.relaynode_serve import cmd_serve, cmd_stop
else:  # on the node: the head uploads the parts side by side
    from relaynode_common import (NAME_RE, Doc, load_manifest, part_path, read_request, record_verified, reply,
                                  sha256_of, write_manifest)
    from relaynode_fetch import cmd_fetch
    from relaynode_serve import cmd_serve, cmd_stop


def commit_one(d: str, name: str, want: str) -> Doc:
    """The head's copy in `.NAME.part`: named when it matches the manifest, removed when it does not."""
    part = part_path(d, name)
    if not NAME_RE.match(name):
        return {"ok": False, "error": "not a plain file name"}
    try:
        got = sha256_of(part)
    except OSError as e:
        return {"ok": False, "error": str(e)}
    if got != want:
        os.unlink(part)
        return {"ok": False, "error": "sha256 %s, the manifest says %s (removed)" % (got, want)}
    os.replace(part, os.path.join(d, name))
    return {"ok": True}


def cmd_commit(req: Doc) -> int:
    """Files the head sent into `.NAME.part`: each checked against the manifest, then named and recorded;
    one that differs is removed (it is sent again)."""
    d = str(req["dir"])
    results = {name: commit_one(d, name, want) for name, want in req["files"].items()}
    good = {n: req["files"][n] for n, r in results.items() if r["ok"]}
    if good:
        record_verified(d, good)
    ok = all(r["ok"] for r in results.values())
    reply({"ok": ok, "files": results})
    return 0 if ok else 4


def _forget(d: str, bad: List[str]) -> None:
    """Files that do not match: removed, and dropped from the manifest, so they are fetched again."""
    for name in bad:
        try:
            os.unlink(os.path.join(d, name))
        except OSError:
            pass
    doc = load_manifest(d)
    for name in bad:
        doc.pop(name, None)
    write_manifest(d, doc)


def cmd_adopt(req: Doc) -> int:
    """Files already here at the right size but never verified (an interrupted run, an older clusterctl):
    hashed, and recorded when they match; the others are left to be fetched again. With "drop_bad" (a
    file another node refused when this one served it), a file that does not match is removed and
    forgotten by the manifest, so it is fetched again."""
    d = str(req["dir"])
    good: Dict[str, str] = {}
    bad: List[str] = []
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
        _forget(d, bad)
    if good:
        record_verified(d, good)
    reply({"ok": True, "verified": sorted(good), "bad": sorted(bad)})
    return 0


def main(argv: List[str]) -> int:
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
