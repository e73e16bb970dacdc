"""`clusterctl wheelhouse build|export|import`: the head's wheelhouse for a lab without internet
(cluster.provision.wheelhouse_plan, wheelhouse_export, wheelhouse_import)."""
from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager

from rich.markup import escape

from cluster import errors
from cluster.cli.args import add_inventory_args, add_json
from cluster.cli.output import emit_json, err, error_line, load_inventory, notes, out, table

if TYPE_CHECKING:
    from rich.progress import Progress

    from cluster.provision.wheelhouse_plan import Selection

ACTIONS = (("build", "download the wheels provision needs for an inventory (or --for targets) into this "
                     "machine's wheelhouse cache"),
           ("export", "copy cached wheelhouses to DIR (a USB disk) with a manifest of sha256s"),
           ("import", "verify an exported DIR by sha256 and add its wheelhouses to this head's cache"))
DESCRIPTIONS = {
    "build": "Fill this machine's wheelhouse cache as `clusterctl provision` would for the inventory: its nodes' "
             "facts (gathered now, or from `--facts`, the head's `clusterctl check --json`), the build plan, one "
             "wheelhouse per requirement set. `--for` names the nodes instead (no inventory). Run it on a Linux "
             "machine with internet of the head's kind: pip downloads for its own platform.",
    "export": "Copy wheelhouses from this machine's cache to DIR, with DIR/manifest.json (every file's sha256 "
              "and size) and DIR/SHA256SUMS. Every complete wheelhouse of the cache, or those an inventory "
              "(or --for) needs. Incremental: files already on DIR with their sha256 are not written again.",
    "import": "On the lab's head: verify every file of an export by sha256 while copying it into a staging "
              "folder, then move the wheelhouses into the cache; a mismatch leaves the cache as it was. "
              "Provision then uses them without network.",
}


def configure(name: str, p: argparse.ArgumentParser) -> None:
    """`wheelhouse` takes an action; each declares its own arguments."""
    sub = p.add_subparsers(dest="wheelhouse_cmd", metavar="ACTION")
    p.set_defaults(fn=_no_action)
    handlers = {"build": cmd_build, "export": cmd_export, "import": cmd_import}
    for action, help in ACTIONS:
        sp = sub.add_parser(action, help=help, description=DESCRIPTIONS[action])
        sp.set_defaults(fn=handlers[action])
        if action in ("export", "import"):
            sp.add_argument("dir", metavar="DIR", help="the export folder (a mounted USB disk, or a folder on it)")
        if action in ("build", "export"):
            _declare_selection(sp, action)
        if action == "build":
            sp.add_argument("--dry-run", action="store_true",
                            help="show the plan and each wheelhouse's requirements, cached or missing; download nothing")
        if action == "import":
            sp.add_argument("--replace", action="store_true",
                            help="replace a wheelhouse the cache has complete with other files (default: keep it)")
        add_json(sp)


def _no_action(args: argparse.Namespace) -> int:
    raise errors.UsageError("clusterctl wheelhouse needs an action: build, export or import",
                            "clusterctl wheelhouse build --help (then export DIR, and import DIR on the head)")


def _declare_selection(sp: argparse.ArgumentParser, action: str) -> None:
    from cluster.provision.wheelhouse_plan import TARGET_HELP

    add_inventory_args(sp)
    sp.add_argument("--facts", metavar="FILE",
                    help="the nodes' facts from `clusterctl check INVENTORY --json` on the head, in place of "
                         "reaching the nodes (a machine with internet is rarely on the lab's network)")
    sp.add_argument("--for", dest="targets", action="append", metavar="TARGETS",
                    help=f"no inventory: the nodes of one lab, {TARGET_HELP}; e.g. --for py3.11,cpu,cu126; "
                         "repeatable")
    sp.add_argument("--torch-index", choices=("pytorch", "pypi"), default="pytorch",
                    help="with --for: where torch comes from, as the inventory var torch_index (default pytorch)")
    sp.add_argument("--extra", action="append", metavar="PACKAGE", default=[],
                    help="with --for: a requirement every node gets, as the inventory var extra_packages")
    if action == "export":
        sp.epilog = "Without INVENTORY, --facts or --for: every complete wheelhouse of the cache."


def _selection(args: argparse.Namespace, default_context: bool) -> Selection | None:
    """The nodes named by INVENTORY / --facts / --for, planned as provision plans them; None: nothing named."""
    from cluster.provision import wheelhouse_plan

    given = args.inventory_pos or args.inventory
    log = notes(args.json)
    if args.targets:
        if given or args.facts:
            raise errors.UsageError("--for names the nodes itself: give it without an inventory or --facts",
                                    "either INVENTORY [--facts FILE], or --for py3.11,cpu")
        targets = wheelhouse_plan.parse_targets(args.targets)
        inv, facts = wheelhouse_plan.target_inventory(targets, args.torch_index, tuple(args.extra))
        return wheelhouse_plan.select(inv, list(inv.hosts.values()), facts,
                                      source="--for " + " --for ".join(args.targets), log=log)
    if args.extra or args.torch_index != "pytorch":
        raise errors.UsageError("--torch-index and --extra go with --for",
                                "with an inventory, set torch_index / extra_packages under its vars:")
    if not given and not args.facts and not default_context:
        return None
    inv = load_inventory(given, args.set, args.ssh_config)
    hosts = inv.select(args.limit)
    if args.facts:
        facts, outcomes = wheelhouse_plan.facts_file(Path(args.facts), hosts)
        return wheelhouse_plan.select(inv, hosts, facts, outcomes, log=log)
    return wheelhouse_plan.select(inv, hosts, forks=args.forks, log=log)


def _left_out_code(sel: Selection) -> int:
    statuses = {o.status for o in sel.left_out.values()}
    if "unreachable" in statuses:
        return errors.EXIT_UNREACHABLE
    return errors.EXIT_FAILED if statuses & {"failed", "refused"} else errors.EXIT_OK


def _print_left_out(sel: Selection) -> None:
    for o in sel.left_out.values():
        if o.status == "skipped":
            out.print(f"[dim]{escape(o.host)}: {escape(o.error or '')}[/dim]")
        else:
            out.print(error_line(o.status, o.host, o.error or o.status, o.fix))


def _selection_dict(sel: Selection) -> dict[str, Any]:
    return {"source": sel.source, "builds": sel.choice.to_dict() if sel.choice else None,
            "nodes": [{"host": o.host, "status": o.status, "error": o.error, "fix": o.fix}
                      for o in sel.left_out.values()]}


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _bytes_bar(quiet: bool, label: str) -> Progress:
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    return Progress(TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                    console=err, transient=True, disable=quiet or not err.is_terminal)


# --------------------------------------------------------------------------- build


def cmd_build(args: argparse.Namespace) -> int:
    from cluster.provision import wheelhouse, wheelhouse_plan

    sel = _selection(args, default_context=True)
    assert sel is not None
    quiet = args.json or args.dry_run
    status: ContextManager[Any] = nullcontext() if quiet else err.status("downloading wheels")
    with status:
        built = wheelhouse_plan.build(sel, dry_run=args.dry_run, log=notes(args.json))
    if args.json:
        emit_json({**_selection_dict(sel), "cache": str(wheelhouse.cache_dir()),
                   "wheelhouses": [b.to_dict() for b in built]})
    else:
        if sel.choice is not None and sel.choice.builds:
            out.print(f"builds: torch {sel.choice.torch}, TensorFlow {sel.choice.tensorflow}, "
                      f"backend {sel.choice.backend}")
        t = table(f"wheelhouses in {wheelhouse.cache_dir()}", ("wheelhouse", "Python", "nodes", "files", "size",
                                                                 "status"), overflow="fold")
        style = {"cached": "dim", "downloaded": "green", "failed": "red", "missing": "yellow"}
        for b in built:
            t.add_row(b.planned.key, b.planned.python, ", ".join(b.planned.nodes),
                      str(b.files) if b.status != "missing" else "-",
                      _size(b.bytes) if b.status != "missing" else "-",
                      f"[{style[b.status]}]{b.status}[/]")
        out.print(t)
        if args.dry_run:
            for b in built:
                out.print(f"  {b.planned.key}: {escape(' '.join(b.planned.requirements))}"
                          + (f" (index {escape(b.planned.index)})" if b.planned.index else ""))
        for b in built:
            if b.error:
                out.print(error_line("failed", b.planned.key, b.error, b.fix))
        _print_left_out(sel)
        if not built:
            out.print("nothing to build: no node installs from a wheelhouse")
        elif args.dry_run:
            out.print("dry run: nothing downloaded" if any(b.status == "missing" for b in built)
                      else "dry run: every wheelhouse is cached")
        elif all(b.status != "failed" for b in built):
            out.print("next: clusterctl wheelhouse export DIR (a USB disk), then on the head: "
                      "clusterctl wheelhouse import DIR")
    code = _left_out_code(sel)
    if any(b.status == "failed" for b in built):
        code = max(code, errors.EXIT_FAILED)
    return code


# --------------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    from cluster.provision import wheelhouse_export

    sel = _selection(args, default_context=False)
    keys = None if sel is None else [s.key for s in sel.sets]
    if sel is not None and not keys:
        raise errors.ClusterError(f"{sel.source}: no node installs from a wheelhouse: nothing to export",
                                  "check the inventory's python_env, or export the whole cache (no INVENTORY)")
    bar = _bytes_bar(args.json, "exporting")
    with bar:
        task = bar.add_task("export", total=None)
        report = wheelhouse_export.export(Path(args.dir), keys, log=notes(args.json),
                                          progress=lambda done, total: bar.update(task, completed=done, total=total))
    if args.json:
        emit_json({**report.to_dict(), **(_selection_dict(sel) if sel else {})})
    else:
        t = table(f"exported to {report.dir}", ("wheelhouse", "Python", "requirements", "files", "size"),
                  overflow="fold")
        for e in report.wheelhouses:
            t.add_row(e.key, e.python, " ".join(e.requirements), str(len(e.files)), _size(e.bytes))
        out.print(t)
        d = report.to_dict()
        out.print(f"{d['files']} files: {report.copied} written ({_size(report.bytes_copied)}), "
                  f"{report.kept} already there and verified; manifest {escape(d['manifest'])}")
        if report.incomplete:
            out.print(f"[dim]left out, incomplete in the cache: {', '.join(report.incomplete)}[/dim]")
        if sel is not None:
            _print_left_out(sel)
        out.print(f"next, on the head: clusterctl wheelhouse import {escape(str(report.dir))}")
    return _left_out_code(sel) if sel is not None else errors.EXIT_OK


# --------------------------------------------------------------------------- import


def cmd_import(args: argparse.Namespace) -> int:
    from cluster.provision.wheelhouse_import import import_dir

    bar = _bytes_bar(args.json, "verifying")
    with bar:
        task = bar.add_task("import", total=None)
        report = import_dir(Path(args.dir), replace=args.replace, log=notes(args.json),
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    if args.json:
        emit_json(report.to_dict())
        return errors.EXIT_OK
    t = table(f"imported from {report.dir}", ("wheelhouse", "Python", "requirements", "files", "size", "status"),
              overflow="fold")
    style = {"imported": "green", "replaced": "green", "present": "dim", "kept": "yellow"}
    for w in report.wheelhouses:
        e = w.entry
        t.add_row(e.key, e.python, " ".join(e.requirements), str(len(e.files)), _size(e.bytes),
                  f"[{style[w.status]}]{w.status}[/]")
    out.print(t)
    out.print(f"{report.files} files verified by sha256 and added to the cache ({_size(report.bytes)})")
    if any(w.status == "kept" for w in report.wheelhouses):
        out.print("note: `kept`: the cache has that wheelhouse complete with other files (built at another time); "
                  "--replace takes the disk's")
    out.print("provision now uses these wheels without network")
    return errors.EXIT_OK
