"""What every part of clusterctl's node-side relay shares: file names, the manifest of verified files, and
the one-JSON-line protocol with the head. Standard library only (the node's system python, 3.8 or newer);
uploaded beside relaynode.py, which is the entry point (its docstring has the protocol)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from typing import Any, Dict

Doc = Dict[str, Any]  # a JSON object, as the head sends and receives it (typing.Dict: Python 3.8 on nodes)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,254}\Z")
MANIFEST = ".clusterctl-manifest.json"
REQUEST_MAX = 65536
CHUNK = 1 << 20


def reply(doc: Doc) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def read_request() -> Doc:
    doc = json.loads(sys.stdin.read() or "{}")
    if not isinstance(doc, dict):
        raise ValueError("the request is not a JSON object")
    return doc


def part_path(d: str, name: str) -> str:
    return os.path.join(d, "." + name + ".part")


def load_manifest(d: str) -> Dict[str, str]:
    try:
        with open(os.path.join(d, MANIFEST)) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def write_manifest(d: str, doc: Dict[str, str]) -> None:
    """The whole manifest, written aside, then renamed (never half a manifest)."""
    tmp = os.path.join(d, ".%s.%d.tmp" % (MANIFEST, os.getpid()))
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, MANIFEST))


def record_verified(d: str, entries: Dict[str, str]) -> None:
    """Add {name: sha256} to the node's manifest."""
    doc = load_manifest(d)
    doc.update(entries)
    write_manifest(d, doc)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
