"""`clusterctl debs build|export|import|list`: the head's bundle of Debian's munge and Slurm packages for PCs
without a package index (cluster.room.debs, debs_carry), carried like the wheelhouse."""
from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from cluster import errors
from cluster.cli.args import add_json
from cluster.cli.output import emit_json, err, notes, out, table

if TYPE_CHECKING:
    from cluster.room.debs import Bundle

ACTIONS = (("build", "download munge's and Slurm's Debian packages for this machine's release into the head's bundle"),
           ("export", "write a bundle as one tar FILE (a USB disk) carrying its manifest of sha256s"),
           ("import", "verify an exported FILE by sha256 and make it this head's bundle for its release"),
           ("list", "the bundles on this head: release, packages, size"))
DESCRIPTIONS = {
    "build": "On a machine with internet (or a Debian mirror) of the PCs' release and architecture: resolve "
             "what the controller (munge slurmctld slurm-client) and the nodes (munge slurmd slurm-client) need "
             "on a bare PC, as apt would, and apt-get download each version into <CLUSTERCTL_HOME>/debs/"
             "<codename>-<arch>/ with a manifest of sha256s. `provision --slurm` installs from it on PCs that "
             "have no package index.",
    "export": "Write the bundle (--release, or the only one) as one tar file: its manifest.json first, then the "
              ".deb files, each checked against its sha256 before it is written.",
    "import": "On the lab's head: read the tar's manifest, then each listed .deb into a staging folder, "
              "verified by sha256; only when all match does it become the head's bundle for that release "
              "(a mismatch, a missing or an unlisted file: nothing imported).",
    "list": "The complete bundles under <CLUSTERCTL_HOME>/debs.",
}


def configure(name: str, p: argparse.ArgumentParser) -> None:
    """`debs` takes an action; each declares its own arguments."""
    sub = p.add_subparsers(dest="debs_cmd", metavar="ACTION")
    p.set_defaults(fn=_no_action)
    handlers = {"build": cmd_build, "export": cmd_export, "import": cmd_import, "list": cmd_list}
    for action, help in ACTIONS:
        sp = sub.add_parser(action, help=help, description=DESCRIPTIONS[action])
        sp.set_defaults(fn=handlers[action])
        if action == "build":
            sp.add_argument("--release", metavar="CODENAME", help="the PCs' VERSION_CODENAME (default: this "
                                                                  "machine's; another is refused)")
            sp.add_argument("--arch", metavar="ARCH", help="the PCs' dpkg architecture (default: this machine's)")
        if action in ("export", "import"):
            sp.add_argument("file", metavar="FILE", help="the tar file (on a mounted USB disk)" + (
                "; a folder: FILE is clusterctl-debs-CODENAME-ARCH.tar in it" if action == "export" else ""))
        if action == "export":
            sp.add_argument("--release", metavar="CODENAME-ARCH",
                            help="which bundle (default: the only one; `clusterctl debs list`)")
        add_json(sp)


def _no_action(args: argparse.Namespace) -> int:
    raise errors.UsageError("clusterctl debs needs an action: build, export, import or list",
                            "clusterctl debs build --help (then export FILE, and import FILE on the head)")


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_build(args: argparse.Namespace) -> int:
    from cluster.room import debs

    status = None if args.json else err.status("downloading Debian packages")

    def progress(done: int, total: int) -> None:
        if status is not None:
            status.update(f"downloading Debian packages: {done}/{total}")

    with status or nullcontext():
        bundle = debs.build(args.release, args.arch, log=notes(args.json), progress=progress)
    if args.json:
        emit_json(bundle.summary())
        return errors.EXIT_OK
    _print_bundles([bundle], f"built in {debs.debs_root()}")
    out.print("next: clusterctl debs export FILE (a USB disk), then on the head: clusterctl debs import FILE")
    return errors.EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from cluster.cli.wheelhouse import _bytes_bar
    from cluster.room import debs_carry

    bundle = debs_carry.choose(args.release)
    bar = _bytes_bar(args.json, "exporting")
    with bar:
        task = bar.add_task("export", total=None)
        report = debs_carry.export(bundle, Path(args.file),
                                   progress=lambda done, total: bar.update(task, completed=done, total=total))
    if args.json:
        emit_json(report)
        return errors.EXIT_OK
    out.print(f"exported {bundle.name}: {len(bundle.debs)} packages ({_size(bundle.bytes)}) to "
              f"{escape(report['file'])}")
    out.print(f"next, on the head: clusterctl debs import {escape(report['file'])}")
    return errors.EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from cluster.cli.wheelhouse import _bytes_bar
    from cluster.room import debs_carry

    bar = _bytes_bar(args.json, "verifying")
    with bar:
        task = bar.add_task("import", total=None)
        bundle, status = debs_carry.import_file(Path(args.file),
                                                progress=lambda done, total: bar.update(task, completed=done,
                                                                                        total=total))
    if args.json:
        emit_json({**bundle.summary(), "status": status, "file": args.file})
        return errors.EXIT_OK
    out.print(f"{bundle.name}: {status}, {len(bundle.debs)} packages verified by sha256 ({_size(bundle.bytes)})")
    out.print("provision --slurm now installs from it on PCs without a package index")
    return errors.EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    from cluster.room import debs

    found = debs.bundles()
    if args.json:
        emit_json({"dir": str(debs.debs_root()), "bundles": [b.summary() for b in found]})
        return errors.EXIT_OK
    if not found:
        out.print(f"no bundle in {escape(str(debs.debs_root()))}: clusterctl debs build (on a connected machine "
                  "of the PCs' release), or clusterctl debs import FILE")
        return errors.EXIT_OK
    _print_bundles(found, f"bundles in {debs.debs_root()}")
    return errors.EXIT_OK


def _print_bundles(found: list[Bundle], title: str) -> None:
    t = table(title, ("release", "packages", "size", "munge", "slurm"), overflow="fold")
    for b in found:
        v = {d["package"]: d["version"] for d in b.debs}
        t.add_row(b.name, str(len(b.debs)), _size(b.bytes), v.get("munge", "-"), v.get("slurm-client", "-"))
    out.print(t)

