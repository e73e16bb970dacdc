"""The command line: `main` parses, runs one command, and maps errors to exit codes (docs/cli.md).

Each command group is a module of this package (COMMANDS says which) with `configure(name, parser)`,
which declares the command's arguments and its handler; the handler calls the library and renders
what it returns. Like pip, only the module of the command being run is imported: `clusterctl --help`
needs nothing but the names and one-line helps below, and `clusterctl exec` loads neither rich.live
nor launch nor report. The library never imports this package.

Takes in: the command line (and the current context). Gives out: output, `--json`, exit codes.
Must never import: nothing is below it; it is the only stage that may import `lab` and that prints or exits.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NamedTuple, Sequence

from cluster import __version__, errors

ABOUT = """\
clusterctl turns a room of PCs reachable over SSH into a cluster for distributed
deep learning: it checks the nodes, installs the same training environment on
each, starts a job (PyTorch DDP or TensorFlow) on all of them at once, brings
the results back and reports what the cluster is worth."""

WORK_ORDER = """\
the order of work:
  1  clusterctl lab up 3              3 simulated nodes on this machine (root)
     clusterctl context room.yaml     or your room's PCs (docs/inventory.md)
  2  clusterctl trust                 record each node's SSH host key
  3  clusterctl check                 each node's facts and problems, with fixes
  4  clusterctl provision             one verified environment on every node
  5  clusterctl launch resnet50-ddp   train on all nodes at once, followed live
  6  clusterctl collect               each node's logs and metrics, to this PC
  7  clusterctl report                throughput, epoch time, accuracy, energy

a room of unequal PCs, between 4 and 5:
     clusterctl bench                 each node's speed alone, and the network's
     clusterctl plan resnet50-ddp     the nodes to use and each node's batch
     clusterctl launch resnet50-ddp --plan

Without an inventory, commands use the current context (set by `lab up`,
`context` and `provision`). `clusterctl COMMAND --help` shows a command's
options; docs/cli.md lists every command and its exit codes."""


class Command(NamedTuple):
    module: str  # cluster.cli.<module> declares its arguments and runs it
    help: str  # the line in `clusterctl --help`, and the command's own description
    description: str | None = None  # the command's --help description where it differs from `help`
    json: bool = True  # takes --json


COMMANDS: dict[str, Command] = {
    "lab": Command("lab", "a simulated lab of SSH nodes in network namespaces (root)",
                   "A simulated lab: one network namespace per node with its own sshd.", json=False),
    "trust": Command("nodes", "record the nodes' SSH host keys at first contact, showing fingerprints"),
    "check": Command("nodes", "reach every node, gather facts, list problems with their fixes"),
    "exec": Command("nodes", "run a shell command on every node: clusterctl exec [INVENTORY] -- CMD"),
    "hosts": Command("nodes", "list the hosts a pattern selects, with address, port, user and key (no contact)"),
    "wake": Command("nodes", "switch on the nodes that are off (Wake-on-LAN) and wait until they answer SSH"),
    "poweroff": Command("nodes", "power the nodes off (through sudo with become) and wait until they are off"),
    "provision": Command("provision", "install and verify an identical training environment on every node"),
    "launch": Command("runs", "start a job on every node at once and follow it: clusterctl launch resnet50-ddp"),
    "runs": Command("runlist", "list one's runs recorded on this head node; --all: every user's jobs in the rooms"),
    "room": Command("room", "who holds which PC of the room's Slurm: every user's queued and running jobs, each "
                            "PC's state"),
    "status": Command("runs", "a run's state on every node (default: the latest run)"),
    "logs": Command("runs", "a run's output on each node (default: the latest run)"),
    "stop": Command("runs", "stop a run on every node, leaving nothing running (default: latest)"),
    "collect": Command("results", "bring a run's logs, metrics, facts and state from every node to the head"),
    "report": Command("results", "tables and plots comparing collected runs (HTML, Markdown, JSON)"),
    "study": Command("results", "run each job on 1, 2, ... N nodes, collect every run and write one report"),
    "bench": Command("bench", "measure each node alone (training images/s) and the network (all-reduce)"),
    "plan": Command("bench", "predict a job's throughput per node set and communication scheme (fp16, PowerSGD, "
                             "accumulation) from `bench`; pick nodes, batch shares and scheme"),
    "context": Command("context", "show or set the current inventory used when none is given"),
    "completion": Command("completion", "print the shell completion script: clusterctl completion bash|zsh",
                          json=False),
    "wheelhouse": Command("wheelhouse", "a head without internet: build the wheels elsewhere, export, import",
                          "The head's wheelhouse carried on a disk: `build` and `export` on a machine with "
                          "internet, `import` on the head (docs/playbooks.md).", json=False),
    "debs": Command("debs", "PCs without a package index: munge's and Slurm's Debian packages, built, exported, "
                            "imported", "The head's bundle of Debian packages for `provision --slurm`: `build` and "
                            "`export` on a connected machine of the PCs' release, `import` on the head "
                            "(docs/playbooks.md).", json=False),
}

DEBUG_ENV = "CLUSTERCTL_DEBUG"  # set to 1: an internal error shows its Python traceback


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's name and help; the arguments of `command` only (its module is imported here)."""
    from cluster.cli.args import add_json  # standard library only, as --help needs

    p = argparse.ArgumentParser(prog="clusterctl", description=ABOUT, epilog=WORK_ORDER,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"clusterctl {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for name, c in COMMANDS.items():
        sp = sub.add_parser(name, help=c.help, description=c.description or c.help)
        if c.json:
            add_json(sp)  # --json and -o json
        if name == command:
            importlib.import_module(f"{__name__}.{c.module}").configure(name, sp)
    return p


def command_named(argv: Sequence[str]) -> str | None:
    """The command word of a command line: its first word that is not an option (the top level's options
    take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit code (docs/cli.md); never lets an exception through.

    A ClusterError is the user's to fix: its message and fix, its exit code. Anything else is a bug
    in clusterctl: one line, exit 70 (EX_SOFTWARE), the traceback only with CLUSTERCTL_DEBUG=1.
    """
    program = argv is None  # the process is clusterctl itself (not a caller's, such as a test's)
    argv = list(sys.argv[1:] if argv is None else argv)
    if program:
        _without_invoke()
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    parser = build_parser(command_named(argv))
    try:
        args, unknown = parser.parse_known_args(argv)  # exits 2 on bad arguments, 0 for --help and --version
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}" + _missing_dashes(args, command, unknown))
        args.command = command
        if command and args.cmd not in ("exec", "launch"):
            parser.error("`--` and a command only go with `clusterctl exec` and `clusterctl launch`")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else errors.EXIT_USAGE
    code = _run(args)
    if program:
        _exit_soon()
    return code


def _missing_dashes(args: argparse.Namespace, command: list[str], unknown: list[str]) -> str:
    """The hint for `clusterctl launch python train.py`: the program's command needs a `--` before it."""
    from cluster.runs.jobs import program_words

    job = getattr(args, "job", None)
    if args.cmd != "launch" or command or not program_words([job or ""] + unknown):
        return ""
    return f"; a program's command goes after `--`: clusterctl launch -- {' '.join([*([job] if job else []), *unknown])}"


def _without_invoke() -> None:
    """paramiko imports invoke, its dependency (~30 ms of a cold command, with asyncio and unittest.mock),
    only to run `Match exec` in paramiko's own SSHConfig, which clusterctl never uses (OpenSSH reads the
    config: `ssh -G`, cluster.inventory.sshconfig). The command's process marks it absent before paramiko
    is imported, so paramiko records it as missing; the library leaves it alone for programs that use it."""
    if "invoke" not in sys.modules:
        sys.modules["invoke"] = None  # type: ignore[assignment]  # Python's "absent" mark: import raises


def _exit_soon() -> None:
    """The process ends next. Python's last collection at exit walks every object the imports made (~50 ms
    of a cold command once paramiko is loaded); frozen, they are left to the exit as they are. The output is
    flushed at exit as always and the command has closed its connections and files: no finalizer is owed."""
    import gc

    gc.freeze()


def _denied(e: PermissionError) -> errors.ClusterError:
    """A file this user may not read or write: clusterctl's own folder (CLUSTERCTL_HOME, say another user's,
    inherited through sudo or runuser) or one the command was given."""
    import getpass
    from pathlib import Path

    from cluster import paths

    where = Path(e.filename) if e.filename else None
    home = paths.home()
    named = "CLUSTERCTL_HOME" if os.environ.get("CLUSTERCTL_HOME") else "the default ~/.clusterctl"
    if where is not None and (where == home or home in where.parents):
        fix = (f"{home} ({named}) holds clusterctl's records, and user {getpass.getuser()} cannot use it "
               f"(ls -ld {home}): unset CLUSTERCTL_HOME or point it at a folder of your own")
    else:
        fix = "run clusterctl as the user who owns it, or change its owner or mode"
    return errors.ClusterError(f"permission denied: {where or e.strerror}", fix, exit_code=errors.EXIT_ENVIRONMENT)


def _run(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from cluster.cli.output import err

    try:
        code: int = args.fn(args)
        return code
    except (errors.ClusterError, PermissionError) as raised:
        # a PermissionError is this account's files, not a bug: which file, and the way out
        e = _denied(raised) if isinstance(raised, PermissionError) else raised
        err.print(f"[red]error:[/red] {escape(e.message)}")
        if e.fix:
            err.print(f"  fix: {escape(e.fix)}")
        return e.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        return errors.EXIT_INTERRUPTED
    except BrokenPipeError:  # `clusterctl runs | head`: the reader left; nothing more to say
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        except OSError:
            pass
        return errors.EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - the last line of defence: a bug, said in one line
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            err.print_exception()
        first = (str(e).splitlines() or [""])[0][:300]
        err.print(f"[red]internal error:[/red] {escape(type(e).__name__)}: {escape(first)}")
        err.print(f"  this is a bug in clusterctl {__version__}; please report it with the command you ran "
                  f"(re-run with {DEBUG_ENV}=1 to see the traceback)")
        return errors.EXIT_INTERNAL
