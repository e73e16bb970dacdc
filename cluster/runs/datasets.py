"""Datasets on the head: prepared once (cluster/programs/wldata.py), staged to every node, verified.

The prepared file's name is a hash of what it is made from (dataset, source file,
image size, split seed, loader code), so a second launch finds it in the head's
cache and on the nodes, and staging sends nothing. `stage_all` puts it on every node
of a launch at once by peer relay (cluster/relay/distribute.py): the head sends it once.
"""
from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cluster import paths
from cluster.relay import distribute
from cluster.errors import ClusterError
from cluster.runs.jobs import JobSpec
from cluster.runs.schema import PROGRAMS_DIR
from cluster.transport import Transport
from cluster.provision.wheelhouse import distribution_mode, sha256_file

if TYPE_CHECKING:
    from cluster.nodes.fanout import Group, GroupResult
    from cluster.inventory.model import Host


@dataclass(frozen=True)
class Prepared:
    file_name: str
    path: Path
    sha256: str
    size: int


def cache_dir() -> Path:
    return paths.home() / "datasets"


def file_name(spec: JobSpec) -> str:
    """`<dataset>-<hash of its inputs>.npz`: known without preparing anything (dry runs)."""
    ds = spec["dataset"]
    source: dict[str, Any] | None = None
    if ds["path"]:
        p = Path(str(ds["path"])).expanduser().resolve()
        st = p.stat()
        source = {"path": str(p), "size": st.st_size, "mtime": st.st_mtime_ns}
    blob = json.dumps({"name": ds["name"], "source": source, "size": ds["size"], "seed": spec["seed"],
                       "loader": hashlib.sha256((PROGRAMS_DIR / "wldata.py").read_bytes()).hexdigest()},
                      sort_keys=True)
    return f"{ds['name']}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}.npz"


def prepare(spec: JobSpec, log: Callable[[str], None] = lambda s: None) -> Prepared:
    """Load and split the dataset on the head (once), as the training programs would."""
    from cluster.programs import wldata

    name = file_name(spec)
    d = cache_dir()
    path, sums = d / name, d / f"{name}.sha256"
    if path.exists() and sums.exists():
        return Prepared(name, path, sums.read_text().split()[0], path.stat().st_size)
    ds = spec["dataset"]
    log(f"preparing dataset {ds['name']} at {ds['size']}px on the head")
    try:
        data = wldata.load(ds["name"], ds["path"], ds["size"], spec["seed"])
    except (OSError, ValueError) as e:
        raise ClusterError(f"dataset {ds['name']}: {e}", "check dataset.path in the job spec or --set") from None
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{name}.part.npz"
    wldata.save(data, tmp)
    digest = sha256_file(tmp)
    tmp.replace(path)
    sums.write_text(f"{digest}  {name}\n")
    return Prepared(name, path, digest, path.stat().st_size)


def stage(t: Transport, prepared: Prepared, progress: Callable[[int], None] | None = None) -> str:
    """Put the prepared file in <workdir>/datasets/ unless an identical one is there; verify by sha256."""
    dest_dir = f"{t.host.workdir}/datasets"
    dest = f"{dest_dir}/{prepared.file_name}"
    q = shlex.quote
    r = t.run(f"test -f {q(dest)} && stat -c %s -- {q(dest)} && sha256sum -- {q(dest)}", timeout=600)
    lines = r.stdout.split()
    if r.exit_code == 0 and lines and lines[0] == str(prepared.size) and lines[1] == prepared.sha256:
        return "present, sha256 verified"
    part = f"{dest_dir}/.{prepared.file_name}.part"
    t.run(f"mkdir -p -- {q(dest_dir)}", timeout=60)
    sent = t.send_file(prepared.path, part)  # a copy cut short earlier (a stall, a lost link) gets only its tail
    got = t.run(f"sha256sum -- {q(part)}", timeout=600).stdout.split()
    if not got or got[0] != prepared.sha256:
        t.run(f"rm -f -- {q(part)}", timeout=60)
        raise ClusterError(f"dataset {prepared.file_name}: sha256 mismatch after the copy (removed on the node)",
                           "launch again; if it repeats, check the node's disk and memory")
    t.run(f"mv -f -- {q(part)} {q(dest)}", timeout=60)
    if progress:
        progress(prepared.size)
    return f"sent {sent / 2**20:.1f} MiB, sha256 verified"


def stage_all(group: Group, hosts: list[Host], prepared: Prepared,
              progress: Callable[[str, int], None] | None = None,
              log: Callable[[str], None] = lambda s: None) -> GroupResult:
    """The prepared file on every node at once: the head sends it once, the nodes relay it to each other
    (a node's copy is re-hashed every launch, as `stage` does). One HostResult per node, ok when its copy
    is in place and verified; the plan and what each node received are in the results' values."""
    items = distribute.items(prepared.path.parent, {prepared.file_name: {"sha256": prepared.sha256,
                                                                    "size": prepared.size}})
    mode = distribution_mode(hosts[0]) if hosts else "relay"
    _, results = distribute.distribute(group, hosts, items, {h.name: f"{h.workdir}/datasets" for h in hosts},
                                  mode=mode, rehash=True, progress=progress, log=log)
    return results
