"""Validate a submission or a retry before anything is written or rented."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ..core.errors import OrbitError
from ..core.submission import TaskSubmission, apply_overrides
from ..core.templates import TaskTemplate, load_template
from .settings import Settings


def validate_submission(settings: Settings, template_name: str, overrides: dict[str, Any], *, experiment: str,
                        project: str) -> tuple[TaskTemplate, TaskSubmission]:
    template = apply_overrides(load_template(template_name), overrides)
    try:
        sub = TaskSubmission(template=template_name, overrides=overrides, experiment=experiment, project=project)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise OrbitError(f"{field} {first.get('input')!r}: {first['msg'].lower()}", field=field,
                         value=first.get("input"), fix="letters, digits, '.', '_' and '-', at most 63 characters") from None
    return template, sub


def validate_retry(settings: Settings, template: TaskTemplate, overrides: dict[str, Any]) -> TaskTemplate:
    return apply_overrides(template, overrides)
