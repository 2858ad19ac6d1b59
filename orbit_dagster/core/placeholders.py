"""Placeholders of a command workload's argv: `{checkpoint_dir}`, `{config.steps}`, ...

One parser for both sides: the control plane checks every element at submit (an unknown
name is an error before anything is rented), the runtime agent fills them in on the host.
Stdlib only: this module travels in every bundle (core/bundle.py RUNTIME_CORE_FILES).

Only plain `{name}` fields are placeholders: no attribute or index access, no `!r` or
`:spec` (str.format would reach into objects; this substitutes text). `{{` and `}}` are
literal braces.
"""
from __future__ import annotations

import json
import string

NAMES = ("checkpoint_dir", "resume_from", "metrics_file", "job_id", "attempt", "checkpoint_every")
EVAL_NAMES = NAMES + ("checkpoint_path",)
CONFIG_PREFIX = "config."


class PlaceholderError(ValueError):
    """An argv element that cannot be filled in: the message says which placeholder and why."""


def fields(element: str) -> list[str]:
    """The placeholder names of one argv element, in order (PlaceholderError when malformed)."""
    try:
        parsed = list(string.Formatter().parse(element))
    except ValueError as exc:  # a lone `{` or `}`
        raise PlaceholderError(f"{exc} (write a literal brace as {{{{ or }}}})") from None
    names = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if spec or conversion:
            raise PlaceholderError(f"placeholder {{{name}}} has a conversion or format spec; write it as {{{name}}}")
        names.append(name)
    return names


def check(element: str, *, allowed: tuple[str, ...], config: dict) -> None:
    """PlaceholderError unless every placeholder of `element` is a known name or `config.KEY` of `config`."""
    for name in fields(element):
        if name.startswith(CONFIG_PREFIX):
            if name[len(CONFIG_PREFIX):] not in config:
                known = ", ".join(sorted(config)) or "(none)"
                raise PlaceholderError(f"placeholder {{{name}}} names no key of config (its keys: {known})")
        elif name not in allowed:
            raise PlaceholderError(f"unknown placeholder {{{name}}} (known: "
                                   f"{', '.join('{' + n + '}' for n in allowed)}, {{config.KEY}})")


def as_text(value: object) -> str:
    """A config value as one argv element: text as is, a bool as true/false, a list or mapping as JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)) or value is None:
        return json.dumps(value)
    return str(value)


def fill(element: str, values: dict[str, str], config: dict) -> str:
    """`element` with every placeholder replaced (the names were checked at submit)."""
    out = []
    for literal, name, _spec, _conversion in string.Formatter().parse(element):
        out.append(literal)
        if name is None:
            continue
        if name.startswith(CONFIG_PREFIX):
            out.append(as_text(config[name[len(CONFIG_PREFIX):]]))
        else:
            out.append(str(values[name]))
    return "".join(out)
