"""YAML from outside (templates, host inventories), parsed with its expansion bounded.

`yaml.safe_load` builds no objects of arbitrary classes, but an alias (`*a`) is the node it
names, so 470 bytes of nested aliases ("billion laughs") stand for 10^9 values: cheap to
parse, as a graph, and endless to walk, print or copy. Here the document's node graph is
composed first and its expanded size counted (each node once, aliases by their targets'
sizes), and a document that expands past `max_nodes`, or whose aliases form a cycle, is
refused before anything is constructed.
"""
from __future__ import annotations

import yaml

MAX_NODES = 100_000


class YamlRefused(ValueError):
    """The document expands past the bound, nests too deeply or refers to itself."""


def expanded_size(root: yaml.Node, limit: int) -> int:
    """Nodes of the document with every alias expanded, counted up to `limit` + 1."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            visiting.discard(key)
            total = 1 + sum(sizes[id(c)] for c in _children(node))
            sizes[key] = min(total, limit + 1)
            continue
        if key in sizes:
            continue
        if key in visiting:
            raise YamlRefused("an alias refers to a node that holds it (a cycle)")
        visiting.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def load(text: str, *, max_nodes: int = MAX_NODES):
    """The document of `text`, like `yaml.safe_load`, or YamlRefused / yaml.YAMLError."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise YamlRefused("it nests too deeply") from None
        if node is None:
            return None
        size = expanded_size(node, max_nodes)
        if size > max_nodes:
            raise YamlRefused(f"its aliases expand it to more than {max_nodes} values")
        try:
            return loader.construct_document(node)
        except RecursionError:
            raise YamlRefused("it nests too deeply") from None
    finally:
        loader.dispose()
