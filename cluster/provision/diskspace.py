"""Is there room on each node for what provision is about to put there? Checked before any byte is sent.

A first provision writes the wheelhouse (~4 GB) and then a venv of everything unpacked (~7 GB with
PyTorch's CUDA libraries) plus the bytecode compiled from it. A disk that fills on the way does not fail
cleanly: a .pyc cut short by a full disk is written whole-looking and a later import dies with
"EOF read where object expected". So provision measures first: on each node, what its wheel folder
and venv already hold (`du`), what the venv has installed (`pip freeze`: a venv that holds the lock
needs nothing more), the free space where the workdir lives (`df`), and the kernel's boot_id.
Nodes with the same boot_id run on the same machine (several GPUs of one PC as nodes, or the simulated
lab's namespaces); when they also share a filesystem, their needs add up against one free space.
"""
from __future__ import annotations

import shlex
import zipfile
from dataclasses import dataclass

from cluster.provision.wheelhouse import Wheelhouse, unsatisfied

MARGIN = 1.05  # + 5%: metadata, the installer's own files, logs
MARGIN_BYTES = 256 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class NodeDisk:
    """What one node reported: its machine (boot_id), the filesystem holding its workdir, the bytes free
    there, and the bytes its wheel folder and venv already hold."""

    boot_id: str
    filesystem: str  # the device, as df names it
    mount: str
    free: int
    wheels_present: int
    venv_present: int
    freeze: str = ""  # the venv's `pip freeze --all`, empty without a venv


@dataclass(frozen=True)
class Need:
    """Bytes a node's provision writes: its wheels, and everything they unpack to (bytecode included)."""

    wheels: int
    installed: int
    lock_text: str  # the pins the venv must hold (wheelhouse.lock_text)

    def on(self, d: NodeDisk) -> int:
        """What this node still needs beyond what it holds, with the margin: nothing for a venv that
        holds every pin already; else what the wheels unpack to, less what the venv holds now."""
        venv = 0 if d.freeze and not unsatisfied(self.lock_text, d.freeze) else \
            max(0, self.installed - d.venv_present)
        rest = max(0, self.wheels - d.wheels_present) + venv
        return int(rest * MARGIN) + MARGIN_BYTES if rest else 0


def command(workdir: str, wheel_dir: str, venv: str) -> str:
    """One round trip: boot_id, the bytes under the wheel folder and the venv (0 when absent), the venv's
    pip freeze, and `df -Pk` of the workdir or its nearest existing parent; sections marked @@."""
    q = shlex.quote
    return ("cat /proc/sys/kernel/random/boot_id; echo @@du; "
            f"for p in {q(wheel_dir)} {q(venv)}; do "
            "if [ -e \"$p\" ]; then du -sb -- \"$p\" | cut -f1; else echo 0; fi; done; echo @@freeze; "
            f"{q(venv + '/bin/python')} -m pip freeze --all --disable-pip-version-check 2>/dev/null; echo @@df; "
            f"d={q(workdir)}; while [ ! -e \"$d\" ]; do d=$(dirname -- \"$d\"); done; df -Pk -- \"$d\"")


def parse(out: str) -> NodeDisk:
    """command()'s output -> NodeDisk; ValueError when it is not what the command prints."""
    head, _, rest = out.partition("@@du\n")
    du, _, rest = rest.partition("@@freeze\n")
    freeze, _, df_text = rest.partition("@@df\n")
    sizes = du.split()
    df = [ln for ln in df_text.splitlines() if ln.strip()]
    if not head.strip() or len(sizes) != 2 or not all(x.isdigit() for x in sizes) or len(df) < 2:
        raise ValueError(f"unexpected output of the disk check: {out.strip()[-300:]!r}")
    fields = df[-1].split()
    if len(fields) < 6 or not fields[3].isdigit():
        raise ValueError(f"unexpected df output: {df[-1]!r}")
    return NodeDisk(head.strip(), fields[0], fields[5], int(fields[3]) * 1024, int(sizes[0]), int(sizes[1]),
                    freeze)


def installed_bytes(wh: Wheelhouse) -> int:
    """What the wheelhouse's wheels unpack to, from their zip directories (nothing is extracted), plus one
    compiled .pyc per .py, counted at the source's size (compiled bytecode is smaller: an upper bound)."""
    total = 0
    for name in wh.files:
        with zipfile.ZipFile(wh.dir / name) as z:
            for i in z.infolist():
                total += i.file_size * (2 if i.filename.endswith(".py") else 1)
    return total


def shortfalls(disks: dict[str, NodeDisk], needs: dict[str, Need]) -> dict[str, str]:
    """Nodes whose filesystem cannot take what provision writes there, each with the reason. Nodes on one
    machine and filesystem share its free space: if their needs together exceed it, all of them fail."""
    shared: dict[tuple[str, str], list[str]] = {}
    for n in needs:
        if n in disks:
            shared.setdefault((disks[n].boot_id, disks[n].filesystem), []).append(n)
    out: dict[str, str] = {}
    for names in shared.values():
        d = disks[names[0]]
        need = sum(needs[n].on(disks[n]) for n in names)
        if need <= d.free:
            continue
        wheels = sum(max(0, needs[n].wheels - disks[n].wheels_present) for n in names)
        what = (f"provisioning needs about {need / GIB:.1f} GiB there ({wheels / GIB:.1f} GiB of wheels, "
                f"the rest unpacked into the venv and compiled)")
        together = f" for {len(names)} nodes on this machine ({', '.join(names)})" if len(names) > 1 else ""
        for n in names:
            out[n] = f"not enough disk space on {d.mount}: {d.free / GIB:.1f} GiB free, {what}{together}"
    return out


FIX = ("free space on that filesystem, or set the node's `workdir:` in the inventory to a larger disk; "
       "nothing was sent or installed")
