"""Ansible host patterns (`--limit`, `clusterctl hosts PATTERN`): Ansible's own matcher, or an exact subset.

Where ansible-core read the inventory (and can still be imported), the pattern goes to Ansible itself
(cluster.inventory.ansible_core.match: `InventoryManager.subset` + `get_hosts`, as `--limit` does). Anywhere
else it is matched here, by the rules of ansible-core's inventory/manager.py (split_host_pattern,
order_patterns, _evaluate_patterns, _match_one_pattern, _split_subscript, _apply_subscript,
_enumerate_matches), for this subset only; anything outside it is refused (exit 2, the term and the fix),
never read some other way. docs/cli.md "Host patterns" is the user's table of the same.

- terms joined by `,` or by `:` (not both: with a comma Ansible reads a `:` literally); whitespace around
  commas is ignored;
- each term: a host name, a group name, `all` (every host), `ungrouped` (hosts in no other group), a glob
  (fnmatch, case-sensitive, over group names and host names: `pc0*`, `pc?1`, `pc0[!3]`), or `~REGEX`
  (Python's re.match: anchored at the start only, so `~pc0` matches pc01), optionally prefixed by `!`
  (exclude) or `&` (intersect);
- a subscript on a non-regex term, with Ansible's inclusive meaning: `[i]` (negative counts from the
  end), `[i:j]` (i to j, both included), `[i:]` (i to the end), over the term's hosts in Ansible's order;
- evaluation as Ansible's: the plain terms unioned in order, then each `&` term, then each `!` term; only
  `!`/`&` terms start from `all`. A term that names a host exactly is that host, even where a group matches.

Refused: `@FILE` limit files, mixing `,` and `:`, a colon form Ansible would read as an address (a part that
is only digits: `host:22`; `::`; an IPv6-like list of hex words), `[x-y]` subscripts (removed from Ansible),
a subscript that cannot be read (`[-1:]`, `[:2]`), a reversed range (`[3:1]`), whitespace inside a term, a
doubled `!`/`&`, an empty `~`, a regex that does not compile, characters no host or group name has.
Where clusterctl keeps stricter than Ansible (Ansible warns and carries on): a term that matches nothing is
an error, as is a pattern that selects no host. Ansible's implicit `localhost` is not a node of the
inventory: not matched. Subscripts are read only on clusterctl's own inventories (a group is its `hosts:`
list, `all` the file's order): in an Ansible inventory read without Ansible, a group's order is Ansible's
walk of its child groups (level by level, deeper levels in hash order), which the built-in reader does not
keep, so a subscript there is refused with the fix (install clusterctl[ansible], or name the hosts).

Takes in: the pattern and the inventory's host names and groups. Gives out: the names selected, in
inventory order. Imports nothing of the inventory's model (cluster.inventory.model imports this).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from cluster.errors import InventoryError, UsageError

IMPLICIT_GROUPS = ("all", "ungrouped")
# Ansible's subscript grammar (PATTERN_WITH_SUBSCRIPT): a trailing [N], [-N], [N:M], [N:] or the removed [N-M].
_SUBSCRIPT = re.compile(r"^(.+)\[(?:(-?[0-9]+)|([0-9]+)([:-])([0-9]*))\]\Z", re.S)
_SUBSCRIPT_LIKE = re.compile(r"\[[0-9:-]*\]\Z")  # a trailing bracket of digits, ':' and '-' only
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]")
_GLOB_TOKEN = re.compile(r"[A-Za-z0-9_.*?-]|\[!?[A-Za-z0-9_.-]+\]")
_HEX_WORD = re.compile(r"[0-9A-Fa-f]{1,4}\Z")
_SPECIAL = (".", "?", "*", "[")  # a term with one of these also matches hosts when it matched a group
SUBSET_DOC = "docs/cli.md, \"Host patterns\""


class PatternError(UsageError):
    """A pattern outside the subset read without Ansible (exit 2): the pattern, the term and the fix."""

    def __init__(self, option: str, pattern: str, term: str | None, why: str, fix: str) -> None:
        where = f"{option} {pattern!r}" + (f": {term!r}" if term is not None and term != pattern else "")
        super().__init__(f"{where}: {why}", fix)
        self.pattern, self.term = pattern, term


@dataclass(frozen=True)
class Term:
    """One term of a pattern: `op` '' (union), '&' (intersect) or '!' (exclude)."""

    text: str  # as written, prefix included
    op: str
    expr: str  # without the prefix and the subscript; `~...` for a regex
    subscript: tuple[int, int | None] | None = None  # (index, None) or (start, end) with end -1 for "to the end"

    @property
    def regex(self) -> bool:
        return self.expr.startswith("~")

    def compiled(self) -> re.Pattern[str]:
        return re.compile(self.expr[1:] if self.regex else fnmatch.translate(self.expr))


def _outside_brackets(text: str) -> list[tuple[int, str]]:
    """(position, character) of every character outside [...]; brackets must balance and not nest."""
    chars: list[tuple[int, str]] = []
    depth = 0
    for i, c in enumerate(text):
        if c == "[":
            if depth:
                raise ValueError("a '[' inside brackets")
            depth = 1
        elif c == "]":
            if not depth:
                raise ValueError("a ']' without its '['")
            depth = 0
        elif not depth:
            chars.append((i, c))
    if depth:
        raise ValueError("a '[' without its ']'")
    return chars


def split(pattern: str, option: str = "--limit") -> list[str]:
    """The terms of a pattern, as Ansible's split_host_pattern gives them, or a PatternError."""
    def refuse(term: str | None, why: str, fix: str) -> PatternError:
        return PatternError(option, pattern, term, why, fix)

    text = pattern.strip()
    if not text:
        raise refuse(None, "an empty pattern", "name hosts or groups, e.g. --limit gpu, or leave it out for all")
    try:
        outside = _outside_brackets(text)
    except ValueError as e:
        raise refuse(None, f"{e}", "brackets hold a subscript (gpu[0:2]) or a character class (pc0[12]x)") from None
    if any(c.isspace() for _, c in outside) and "," not in text:
        raise refuse(None, "whitespace between terms", "separate terms with ',' (gpu,pc03) or ':' (gpu:!pc03)")
    if "," in text:
        terms = [t.strip() for t in text.split(",")]
        for t in terms:
            if any(c == ":" for _, c in _outside_brackets_safe(t)):
                raise refuse(t, "a ':' in a comma-separated pattern (Ansible reads it as part of a name there)",
                             "use one separator: gpu,!pc03 or gpu:!pc03")
        return [t for t in terms if t]
    cuts = [i for i, c in outside if c == ":"]
    if not cuts:
        return [text]
    parts = [text[a + 1:b] for a, b in zip([-1, *cuts], [*cuts, len(text)])]
    if any(not p for p in parts):
        raise refuse(None, "an empty part between ':' (Ansible may read the pattern as an IPv6 address)",
                     "write each term between single ':' or use ',': gpu,!pc03")
    if len(parts) >= 7 and all(_HEX_WORD.match(p) or p.startswith("[") for p in parts[:-1]):
        raise refuse(None, "it reads as an IPv6 address to Ansible", "name the host, or separate terms with ','")
    digits = [p for p in parts if p.isdigit()]
    if digits:
        raise refuse(digits[0], "a part that is only digits: Ansible reads `name:N` as a host and its port",
                     "separate terms with ',' instead (gpu,!pc03), or give the host's name")
    return parts


def _outside_brackets_safe(term: str) -> list[tuple[int, str]]:
    try:
        return _outside_brackets(term)
    except ValueError:
        return [(i, c) for i, c in enumerate(term)]


def parse(pattern: str, option: str = "--limit", subscripts: bool = True) -> list[Term]:
    """Every term of `pattern`, checked against the subset; `subscripts` False refuses [..] (see the module)."""
    out: list[Term] = []
    for text in split(pattern, option):
        out.append(_term(pattern, text, option, subscripts))
    return out


def _term(pattern: str, text: str, option: str, subscripts: bool) -> Term:
    def refuse(why: str, fix: str) -> PatternError:
        return PatternError(option, pattern, text, why, fix)

    if any(c.isspace() for c in text):
        raise refuse("whitespace inside a term", "host and group names have no spaces; separate terms with ','")
    if text.startswith("@"):
        raise refuse("a limit file (@FILE) is not in the subset read without Ansible",
                     "list the hosts with commas, or install clusterctl[ansible] (Ansible reads @FILE)")
    op, body = (text[0], text[1:]) if text[0] in "!&" else ("", text)
    if not body:
        raise refuse(f"'{op}' with nothing after it", f"write {op}NAME, e.g. gpu:{op}pc03")
    if body[0] in "!&@":
        raise refuse(f"'{body[0]}' after '{op or body[0]}' (Ansible reads it as part of a name)",
                     "one prefix per term: !NAME excludes, &NAME intersects")
    if body.startswith("~"):
        if len(body) == 1:
            raise refuse("an empty regular expression", "write all for every host, or ~REGEX")
        try:
            re.compile(body[1:])
        except (re.error, RecursionError, OverflowError) as e:
            raise refuse(f"not a regular expression: {e}", "a Python regular expression after ~, e.g. ~pc0[12]") \
                from None
        return Term(text, op, body)
    expr, sub = body, None  # type: str, tuple[int, int | None] | None
    m = _SUBSCRIPT.match(body)
    if m:
        expr, index, start, sep, end = m.groups()
        if sep == "-":
            raise refuse("a [x-y] subscript (removed from Ansible, which reads it as [x:y] with a warning)",
                         f"[{start}:{end}] for hosts {start} to {end} of the group, or ~REGEX for a character "
                         "class")
        if index is not None:
            sub = (int(index), None)
        else:
            first, last = int(start), int(end) if end else -1
            if end and last < first:
                raise refuse(f"a reversed range [{start}:{end}]", f"write [{end}:{start}]: both ends are included")
            sub = (first, last)
        if not subscripts:
            raise refuse("a subscript on an Ansible inventory read without Ansible (its groups' order is Ansible's "
                         "walk of their child groups, which the built-in reader does not keep)",
                         "install clusterctl[ansible] (Ansible's own matcher is used then), or name the hosts")
    elif _SUBSCRIPT_LIKE.search(body):
        raise refuse("a subscript Ansible cannot read", "[i], [-i], [i:j] or [i:] (i and j counted from 0, both "
                     "included)")
    pos = 0
    while pos < len(expr):
        tok = _GLOB_TOKEN.match(expr, pos)
        if tok is None:
            c = expr[pos]
            raise refuse(f"{c!r} is in no host or group name" if not _NAME_CHARS.match(c) and c not in "[]" else
                         "a bracket that is not a character class ([abc], [!abc], [a-c]) or a subscript",
                         f"letters, digits, '.', '_', '-', globs (* ? [abc]) or ~REGEX; see {SUBSET_DOC}")
        pos = tok.end()
    return Term(text, op, expr, sub)


def ordered(terms: Sequence[Term]) -> list[Term]:
    """Ansible's order_patterns: plain terms, then `&`, then `!`; `all` first where no plain term is given."""
    plain = [t for t in terms if not t.op]
    if not plain:
        plain = [Term("all", "", "all")]
    return plain + [t for t in terms if t.op == "&"] + [t for t in terms if t.op == "!"]


def group_table(hosts: Sequence[str], groups: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The groups as Ansible lists them: `all`, `ungrouped`, then the inventory's, in its order."""
    grouped = {h for g, members in groups.items() if g not in IMPLICIT_GROUPS for h in members}
    table = {"all": list(hosts), "ungrouped": [h for h in hosts if h not in grouped]}
    table.update({g: list(m) for g, m in groups.items() if g not in IMPLICIT_GROUPS})
    return table


def _hosts_of(term: Term, hosts: Sequence[str], table: Mapping[str, Sequence[str]]) -> list[str]:
    """_match_one_pattern: the term's hosts (duplicates kept, as Ansible's subscript sees them)."""
    rx = term.compiled()
    found: list[str] = []
    matched_groups = [g for g in table if rx.match(g)]
    for g in matched_groups:
        found.extend(table[g])
    if not matched_groups or term.regex or any(s in term.expr for s in _SPECIAL):
        found.extend(h for h in hosts if rx.match(h))
    return found


def _subscripted(term: Term, found: list[str], pattern: str, option: str) -> list[str]:
    """_apply_subscript, inclusive: [i] one host, [i:j] i..j, [i:] i to the end."""
    if not found or term.subscript is None:
        return found
    start, end = term.subscript
    if end is None:
        if not -len(found) <= start < len(found):
            raise PatternError(option, pattern, term.text, f"no host at [{start}]: {term.expr} has {len(found)} "
                               f"host(s) here", f"use [0] to [{len(found) - 1}], or [-1] for the last")
        return [found[start]]
    return found[start:(len(found) - 1 if end == -1 else end) + 1]


def match(pattern: str, hosts: Sequence[str], groups: Mapping[str, Sequence[str]], where: str,
          option: str = "--limit", subscripts: bool = True) -> list[str]:
    """The host names `pattern` selects, in inventory order (`hosts`' order), by the subset's rules.

    Errors name the file (`where`) and the option, as every --limit error does: a term that matches
    nothing, a pattern that selects no host; a PatternError for anything outside the subset.
    """
    terms = parse(pattern, option, subscripts)
    table = group_table(hosts, groups)
    for g in IMPLICIT_GROUPS:  # Ansible's own two: a group of the inventory by that name would be a different set
        if g in groups and set(groups[g]) != set(table[g]):
            raise InventoryError(where, None, f"groups.{g}", f"a group named '{g}' is not Ansible's '{g}' "
                                 f"({'every host' if g == 'all' else 'the hosts in no other group'}), which "
                                 f"{option} patterns mean by it", "rename the group")
    known = set(hosts)
    chosen: list[str] = []
    for term in ordered(terms):
        if not term.op and term.text in known:  # _evaluate_patterns: a host named exactly is that host
            that = [term.text]
        else:
            that = _subscripted(term, _hosts_of(term, hosts, table), pattern, option)
        if not that:
            names = ", ".join(list(hosts) + [g for g in groups if g not in IMPLICIT_GROUPS])
            why = f"'{term.text}' matches no host or group"
            if term.subscript is not None:  # pc0[12]: Ansible's subscript [12] of `pc0`, not a character class
                why += f" (its trailing [..] is a subscript of '{term.expr}', as Ansible reads it)"
                names += "; a character class at the end: ~REGEX, e.g. ~pc0[12]"
            raise InventoryError(where, None, option, why, f"use one of: {names} (patterns: {SUBSET_DOC})")
        if term.op == "!":
            gone = set(that)
            chosen = [h for h in chosen if h not in gone]
        elif term.op == "&":
            keep = set(that)
            chosen = [h for h in chosen if h in keep]
        else:
            chosen.extend(h for h in that if h not in chosen)
    if not chosen:
        raise InventoryError(where, None, option, f"'{pattern}' selects no host",
                             "check the pattern's ! and & terms: `clusterctl hosts PATTERN` lists what each "
                             "part selects")
    picked = set(chosen)
    return [h for h in hosts if h in picked]
