"""Argument declarations several commands share, and argparse types for numbers.

Imports nothing but argparse and cluster.bounds (standard library only, the check every number a user
gives passes): every command module declares its arguments with these, and a `clusterctl CMD --help`
should not pay for rich or the library.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, TypeVar

from cluster.bounds import Range

N = TypeVar("N", int, float)

DEFAULT_INVENTORY_HELP = "inventory YAML (default: the current context)"


def _number(kind: Callable[[str], N], minimum: float, strict: bool,
            maximum: float | None = None) -> Callable[[str], N]:
    """An argparse type: a number of `kind` >= minimum (> with `strict`), and <= maximum when given, finite
    either way (cluster.bounds: `nan` and `inf` parse as floats); anything else is exit 2, said so."""
    rng = Range(minimum, math.inf if maximum is None else maximum, integer=kind is int, low_open=strict)

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {rng.kind}, got {text!r}") from None
        problem = rng.problem(value)
        if problem is not None:  # the whole range said (argparse shows no fix line), "finite" where it was not
            finite = not isinstance(value, float) or math.isfinite(value)
            raise argparse.ArgumentTypeError(f"expected {rng if finite else problem}, got {text!r}")
        return value
    parse.__name__ = getattr(kind, "__name__", "number")  # argparse names the type in its messages
    return parse


POSITIVE_INT, POSITIVE_FLOAT = _number(int, 0, strict=True), _number(float, 0, strict=True)
# a wait given in seconds: at most a day, as the inventory's command_timeout (docs/inventory.md)
TIMEOUT_S, GRACE_S = _number(float, 0, strict=True, maximum=86400), _number(float, 0, strict=False, maximum=3600)
NON_NEGATIVE_INT, NON_NEGATIVE_FLOAT = _number(int, 0, strict=False), _number(float, 0, strict=False)
WAKE_S = _number(float, 0, strict=True, maximum=3600)  # waiting for PCs to boot or to go off
FRACTION = _number(float, 0, strict=True, maximum=1)  # a share such as an accuracy: 0.9, not 90


LIMIT_HELP = ("an Ansible host pattern: names, groups, globs (pc0*), ~regex, a:b or a,b (union), a:!b "
              "(except), a:&b (and), group[0:2] (docs/cli.md, Host patterns)")


class _OutputFormat(argparse.Action):
    """`-o json`: kubectl's spelling of --json (sets the same `json` flag)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, "json", True)


def add_json(p: argparse.ArgumentParser) -> None:
    """--json, and -o json (the same)."""
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("-o", action=_OutputFormat, choices=("json",), dest="json", default=argparse.SUPPRESS,
                   metavar="json", help="-o json: the same as --json")


def add_limit(p: argparse.ArgumentParser, help: str = LIMIT_HELP) -> None:
    p.add_argument("--limit", metavar="PATTERN", help=help)


def add_inventory_option(p: argparse.ArgumentParser, help: str = DEFAULT_INVENTORY_HELP) -> None:
    p.add_argument("-i", "--inventory", metavar="INVENTORY", help=help)
    p.add_argument("-F", dest="ssh_config", metavar="FILE",
                   help="the OpenSSH client config to read, as `ssh -F` (default ~/.ssh/config; `none`: none); "
                        "the same as --set ssh_config=FILE on every host")


def add_forks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--forks", type=POSITIVE_INT, default=32, help="nodes contacted at once (default 32)")


def add_job_settings(p: argparse.ArgumentParser, help: str = "job setting, e.g. --set batch=16") -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=help)


def add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", metavar="RUN", help="run id or a unique prefix (default: the latest)")


def add_price(p: argparse.ArgumentParser) -> None:
    p.add_argument("--price-kwh", type=NON_NEGATIVE_FLOAT, metavar="PRICE",
                   help="electricity price per kWh, for the cost column")


def add_inventory_args(p: argparse.ArgumentParser,
                       help: str = "inventory YAML (default: the current context, see `clusterctl context`)") -> None:
    """The node commands' way to name an inventory and the nodes in it."""
    p.add_argument("inventory_pos", nargs="?", metavar="INVENTORY", help=help)
    add_inventory_option(p, "inventory YAML (same as the positional)")
    add_limit(p)
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a host field on every host (e.g. --set user=student); repeatable")
    add_forks(p)


def add_outside_slurm(p: argparse.ArgumentParser) -> None:
    """The admin's way past the refusal on PCs a room's Slurm holds (cluster.room.held)."""
    p.add_argument("--outside-slurm", action="store_true",
                   help="run on PCs the room's Slurm holds, beside its jobs (admin)")


def add_power(p: argparse.ArgumentParser) -> None:
    """`--wake` and `--poweroff-after`: a room whose PCs are off when nobody is there (launch, study); and
    --outside-slurm, which both take too."""
    add_outside_slurm(p)
    p.add_argument("--wake", action="store_true",
                   help="first wake the nodes that are off (Wake-on-LAN; `clusterctl wake`) and wait for them")
    p.add_argument("--wake-timeout", type=WAKE_S, default=180.0, metavar="S",
                   help="how long --wake waits for the nodes to answer SSH (default 180 s)")
    p.add_argument("--poweroff-after", action="store_true",
                   help="power the nodes off once the results are collected on this head (through sudo with become)")
