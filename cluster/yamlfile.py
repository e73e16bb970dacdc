"""YAML that remembers where each key was written, so errors can name the line."""
from __future__ import annotations

from typing import Any

import yaml


class Map(dict):
    """A mapping that remembers the line of each key, and keys seen twice."""

    line: int = 0
    lines: dict[Any, int]
    dups: list[tuple[Any, int, int]]


class Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: Loader, node: yaml.MappingNode) -> Map:
    loader.flatten_mapping(node)
    out = Map()
    out.line, out.lines, out.dups = node.start_mark.line + 1, {}, []
    for knode, vnode in node.value:
        key = loader.construct_object(knode, deep=True)
        line = knode.start_mark.line + 1
        if key in out.lines:
            out.dups.append((key, out.lines[key], line))
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
