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
        try:
            hash(key)
        except TypeError:
            # SafeLoader's own check, kept: a list or mapping as a key is a YAML error with its line.
            raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                    f"found a {type(key).__name__} as a key (unhashable)",
                                                    knode.start_mark) from None
        try:
            hash(key)
        except TypeError:  # `? [a, b]: 1` or `{a: 1}: 2`: a MarkedYAMLError, so every loader reports file:line
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"a {type(key).__name__} cannot be a key (keys are names: write it as a plain string)",
                knode.start_mark) from None
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
