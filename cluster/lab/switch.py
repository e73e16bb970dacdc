"""A lab node's power switch: its `poweroff`, `shutdown`, `halt` and `systemctl`, in its own mount namespace.

The lab's nodes share this machine's /usr, so the real commands would switch off the machine itself. In
each node's namespace a script of the lab's takes their place (mounted by cluster.lab.sshd's start); it runs
`python -m cluster.lab.power switch NODE`, which powers off that node only (cluster.lab.power). The PC's
systemctl is cluster.lab.units (units run inside the PC); its `systemctl poweroff` is this switch. The
gateway PC gets that systemctl too, and no switch.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from cluster.lab.pc import shim
from cluster.lab.state import NodeState

# The PC's own commands that switch it off; the lab's script takes their place in each node's mount namespace.
SWITCHES = ("poweroff", "shutdown", "halt", "systemctl")
SWITCH_SCRIPT = """\
#!/bin/sh
# clusterctl lab {lab}: {node}'s power switch, in place of poweroff, shutdown, halt and systemctl poweroff
# (this lab's nodes share the machine's /usr: the real ones would switch off the machine itself).
if [ "$(id -u)" != 0 ]; then echo "$(basename "$0"): must be root (use sudo)" >&2; exit 1; fi
# Apart from the session first: switching the node off ends every process in it but this one, which then
# waits for the node's magic packet (the NIC of a PC that is off).
# (the code of the clusterctl that made the lab, whatever sudo leaves of the caller's environment)
PYTHONPATH={root_q} setsid {python} -m cluster.lab.power switch {node_q} --name {lab_q} --dir {dir_q} </dev/null >>{log_q} 2>&1 &
echo "{node}: powering off"
"""



def power_bin(node: NodeState, lab: str | None, lab_dir: Path) -> list[tuple[Path, Path]]:
    """The PC's systemctl (cluster.lab.units) and a node's switch script (`lab` None: the gateway, no switch),
    and (file, mount point) pairs that put them over the PC's own commands: their folder on /usr/local/sbin
    (first on root's and sudo's PATH), and over every real file those commands resolve to (Debian:
    /usr/sbin/poweroff -> /bin/systemctl, whose shim hands poweroff to the switch)."""
    nd = Path(node.dir)
    bin_dir = nd / "power-bin"
    bin_dir.mkdir(exist_ok=True)
    q = shlex.quote
    if lab is not None:
        script = SWITCH_SCRIPT.format(lab=lab, node=node.name, node_q=q(node.name), lab_q=q(lab),
                                      dir_q=q(str(lab_dir)), python=q(sys.executable), log_q=q(str(nd / "power.log")),
                                      root_q=q(str(Path(__file__).resolve().parents[2])))
        for name in SWITCHES[:-1]:
            (bin_dir / name).write_text(script)
            (bin_dir / name).chmod(0o755)
    (bin_dir / "systemctl").write_text(shim(bin_dir / "poweroff" if lab is not None else None))
    (bin_dir / "systemctl").chmod(0o755)
    mounts = [(bin_dir, Path("/usr/local/sbin"))] if Path("/usr/local/sbin").is_dir() else []
    real = sorted({(Path(d) / n).resolve() for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin") for n in SWITCHES
                   if (Path(d) / n).exists()})
    for target in real:
        if target.is_file() and not str(target).startswith(str(bin_dir)):
            if target.name == "systemctl":
                mounts.append((bin_dir / "systemctl", target))
            elif lab is not None:
                mounts.append((bin_dir / "poweroff", target))
    return mounts
