"""`clusterctl completion bash|zsh`: the shell completion script, generated from the parser by shtab.

The parser is built whole here (every command's module configured), so the script completes every
command, subcommand and option, and choices such as `-o json` or `lab up|down|status`; file arguments
(inventories, job specs) complete as paths. Install: `clusterctl completion bash > ~/.local/share/
bash-completion/completions/clusterctl`, or `source <(clusterctl completion bash)` in ~/.bashrc; for zsh,
`clusterctl completion zsh > "${fpath[1]}/_clusterctl"` (docs/cli.md).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from cluster import errors

SHELLS = ("bash", "zsh")


def configure(name: str, p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", nargs="?", choices=SHELLS, metavar="SHELL",
                   help="bash or zsh (default: the one $SHELL names)")
    p.set_defaults(fn=cmd_completion)


def full_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command's arguments declared (main builds only the one it runs)."""
    from cluster import cli

    parser = cli.build_parser(None)
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                importlib.import_module(f"cluster.cli.{cli.COMMANDS[name].module}").configure(name, sub)
    return parser


FILES = ("inventory", "inventory_pos", "requirements", "html", "markdown")  # dests that name a file
FOLDERS = ("code", "dir")  # dests that name a folder


def _walk(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = list(parser._actions)  # noqa: SLF001
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                actions += _walk(sub)
    return actions


def script(shell: str) -> str:
    """The completion script for `shell` (bash or zsh)."""
    import shtab

    parser = full_parser()
    for action in _walk(parser):  # paths complete as paths (shtab reads `complete` off the action)
        if action.dest in FILES:
            action.complete = shtab.FILE  # type: ignore[attr-defined]
        elif action.dest in FOLDERS:
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
    return str(shtab.complete(parser, shell=shell))


def cmd_completion(args: argparse.Namespace) -> int:
    shell = args.shell or os.path.basename(os.environ.get("SHELL", ""))
    if shell not in SHELLS:
        raise errors.UsageError(f"no shell named and $SHELL is {os.environ.get('SHELL') or 'unset'}",
                                "name one: clusterctl completion bash (or zsh)")
    try:
        text = script(shell)
    except ImportError:
        raise errors.ClusterError("the shtab library is not installed", "pip install shtab (a dependency of "
                                  "clusterctl: reinstall it)", exit_code=errors.EXIT_ENVIRONMENT) from None
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return errors.EXIT_OK
