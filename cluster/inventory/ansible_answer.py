"""The answer both Ansible readers give (ansible-core in a child process, or the built-in YAML subset).

One shape, so cluster.inventory.ansible maps either to hosts the same way; the child sends it as JSON.
"""
from __future__ import annotations

from typing import Any, TypedDict

# The connection fields as Ansible's connection plugin resolves them: connection, address, port, user, key.
Conn = dict[str, Any]


class AnsweredHost(TypedDict):
    name: str
    groups: list[str]  # every group but `all`, sorted
    conn: Conn
    vars: dict[str, Any]  # templated inventory variables
    errors: dict[str, str]  # variables Ansible could not template before a play: the reason
    origins: dict[str, list[Any] | None]  # variable -> [file, line] where Ansible read it, when known


class _AnswerFields(TypedDict):
    ansible: str | None  # ansible-core's version; None: the built-in reader
    config_file: str | None
    default_transport: str
    plugins: dict[str, str]  # source -> the inventory plugin that parsed it
    warnings: list[str]
    hosts: list[AnsweredHost]
    groups: dict[str, list[str]]  # group -> its hosts (descendants' included), in inventory order


class Answer(_AnswerFields, total=False):
    format: int  # the cache's format (ansible_inventory.FORMAT_VERSION), set by ansible_inventory.resolve
    cached: bool
