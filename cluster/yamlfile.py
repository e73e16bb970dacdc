"""YAML that remembers where each key was written, so errors can name the line."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import yaml


class Map(dict[Any, Any]):
    """A mapping that remembers the line of each key, and keys seen twice."""

    line: int = 0
    lines: dict[Any, int | None]
    dups: list[tuple[Any, int, int]]

    @classmethod
    def new(cls, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]] = (), line: int = 0,
            lines: dict[Any, int | None] | None = None) -> Map:
        """A Map built in code (not parsed): its line, its keys' lines (none by default), no duplicates."""
        out = cls(items)
        out.line, out.lines, out.dups = line, {} if lines is None else lines, []
        return out


class Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: Loader, node: yaml.MappingNode) -> Map:
    loader.flatten_mapping(node)
    out = Map.new(line=node.start_mark.line + 1)
    for knode, vnode in node.value:
        key = loader.construct_object(knode, deep=True)
        line = knode.start_mark.line + 1
        try:
            hash(key)
        except TypeError:
            # SafeLoader's own check, kept: a list or mapping as a key is a YAML error with its line.
            raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                    f"found a {type(key).__name__} as a key (unhashable)",
                                                    knode.start_mark) from None
        first = out.lines.get(key)
        if first is not None:
            out.dups.append((key, first, line))
        out.lines[key] = line
        out[key] = loader.construct_object(vnode, deep=True)
    return out


Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def line_of(m: Any, key: Any = None) -> int | None:
    if isinstance(m, Map):
        return m.lines.get(key, m.line) if key is not None else m.line
    return None


def load(text: str) -> Any:
    """Parse YAML safely (Loader is a SafeLoader) into Maps with line numbers."""
    return yaml.load(text, Loader=Loader)  # noqa: S506


NUL_MESSAGE = "holds a NUL byte (\\0), which no command line or file can carry"  # with nul_in


def nul_in(value: Any, where: str = "") -> str | None:
    """Where a NUL byte is in a string, a key or a nested value of `value` ("" for `value` itself, "a[1]" for
    an item of its key a); None where there is none."""
    if isinstance(value, str):
        return where if "\0" in value else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str):
            name = k.replace("\0", "\\0")
            at = f"{where}.{name}" if where else name
            if "\0" in k:
                return at
        else:
            at = f"{where}[{k}]"
        found = nul_in(v, at)
        if found is not None:
            return found
    return None
