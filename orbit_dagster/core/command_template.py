"""What a command workload's template adds to the checks of a template (docs/bring-your-own.md).

A command workload may come without a config schema (its values are then only data), and its
argv's placeholders are checked when the template is loaded and at every submit, so an
unknown `{name}` is an error before anything is rented.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from . import placeholders
from .config_schema import SCHEMA_FILE, show
from .errors import OrbitError
from .workload import workload_dir

if TYPE_CHECKING:  # templates.py imports this module
    from .templates import TaskTemplate

def has_config_schema(workload: str) -> bool:
    try:
        return (workload_dir(workload) / SCHEMA_FILE).is_file()
    except (OSError, ValueError, OrbitError):
        return True  # config_schema() then names what is wrong with the workload


def plain_config(config: Any, *, error: type[OrbitError], context: str) -> dict[str, Any]:
    """A command workload's config without a schema: a mapping of JSON values (text keys; numbers,
    text, booleans, null, lists and mappings of them), passed to the script as they are."""
    if not isinstance(config, dict):
        raise error(f"{context}: field 'config' must be a mapping of hyper-parameters, not {show(config)}",
                    field="config", value=config, fix="write `config:` followed by `key: value` lines")
    stack: list[tuple[str, Any]] = [("config", config)]
    while stack:
        where, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            path = f"{where}.{key}" if isinstance(node, dict) else f"{where}[{key}]"
            if isinstance(node, dict) and not isinstance(key, str):
                raise error(f"{context}: key {show(key)} of {where} is not text", field=where, value=key,
                            fix="quote the key")
            if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
                raise error(f"{context}: field {path} is {value}, not a finite number", field=path, value=value,
                            fix="give a finite number")
            if isinstance(value, (dict, list)):
                stack.append((path, value))
            elif not (value is None or isinstance(value, (str, int, float, bool))):
                raise error(f"{context}: field {path} is {show(value)}, not a JSON value", field=path, value=value,
                            fix="give a number, text, true/false, null, a list or a mapping")
    return copy.deepcopy(config)


def check_placeholders(template: "TaskTemplate", *, error: type[OrbitError], context: str) -> None:
    """Every `{name}` of the train and eval argv is one the agent fills in (core/placeholders.py)."""
    argvs = [("command", template.command, placeholders.NAMES)]
    if template.eval is not None:
        argvs.append(("eval.command", template.eval.command, placeholders.EVAL_NAMES))
    for field, argv, allowed in argvs:
        for i, element in enumerate(argv or ()):
            try:
                placeholders.check(element, allowed=allowed, config=template.config)
            except placeholders.PlaceholderError as exc:
                name = f"{field}[{i}]"
                fix = ("{checkpoint_path} exists only in eval.command" if "{checkpoint_path}" in str(exc)
                       and field == "command" else
                       f"use one of {', '.join('{' + n + '}' for n in allowed)} or {{config.KEY}} of a config key")
                raise error(f"{context}: field {name} = {show(element)}: {exc}", field=name, value=element,
                            fix=fix) from None
