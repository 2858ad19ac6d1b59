"""Everything a submission or a retry must pass before anything is rented or written.

`validate_submission` and `validate_retry` check, in this order: the names (pattern and
length), the overrides (count, key shape, value size; each against the template's
whitelist), the whole template against its types and the workload's config schema, the
GPU name against the catalog, and whether the placement x launch mode x checkpoint store
can be served here: a provider for the backend key, the S3 store's setting, AWS
credentials, an SSH host that fits, an image for docker. Each rejection is one OrbitError
naming the field, the value and the fix. Neither function writes anything: no ledger, no
bundle, no provider state.
"""
from __future__ import annotations

import difflib
import re
from typing import Any, get_args

from ..catalog.gpus import UnknownGpu, gpu_family, known_gpu_names
from ..core.config_schema import show
from ..core.errors import InvalidOverride, OrbitError
from ..core.execution import Placement
from ..core.submission import TaskSubmission, apply_overrides, check_name, check_overrides, check_template_ref
from ..core.templates import TaskTemplate, load_template
from ..providers.ssh.inventory import InventoryError, load_inventory
from ..settings import Settings
from . import providers

AWS_REGION = r"^[a-z]{2}(-[a-z]+)+-[0-9]+$"


class NotServedHere(OrbitError):
    """The job asks for a placement, launch mode or store that this control plane cannot serve."""


def validate_submission(settings: Settings, template_name: str, overrides: dict[str, Any] | None, *,
                        experiment: str, project: str) -> tuple[TaskTemplate, TaskSubmission]:
    """The template with its overrides, and the submission, both valid; or one OrbitError."""
    check_template_ref(template_name)
    check_name("experiment", experiment)
    check_name("project", project)
    overrides = dict(check_overrides(overrides if overrides is not None else {}))
    template = apply_overrides(load_template(template_name, settings.template_dirs), overrides)
    check_serviceable(settings, template, overrides)
    submission = TaskSubmission(template=template_name, overrides=overrides, experiment=experiment, project=project)
    return template, submission


def validate_retry(settings: Settings, snapshot_template: TaskTemplate, overrides: dict[str, Any] | None) -> TaskTemplate:
    """The frozen template of a job with a retry's overrides, checked as a new submission is:
    the snapshot itself is re-validated too, since what was accepted once (by an older
    version, or with S3 configured then) may not run now."""
    overrides = dict(check_overrides(overrides if overrides is not None else {}))
    template = apply_overrides(snapshot_template, overrides)
    check_serviceable(settings, template, overrides)
    return template


def check_serviceable(settings: Settings, template: TaskTemplate, overrides: dict[str, Any]) -> None:
    _check_backend(template, overrides)
    _check_gpu(settings, template, overrides)
    _check_store(settings, template, overrides)
    if template.launch_mode == "docker_image" and not template.image:
        raise _error(overrides, "launch_mode", template.launch_mode,
                     "launch_mode docker_image needs an image, and the template names none",
                     "set `image:` in the template (e.g. a registry path), or use launch_mode host_process")
    if template.placement == "aws_spot":
        _check_aws(settings, overrides)
    if template.placement == "ssh_rental":
        _check_ssh_hosts(settings, template, overrides)
    if template.resources.nodes > 1:
        _check_group(settings, template, overrides)


def _error(overrides: dict, field: str, value: object, message: str, fix: str) -> OrbitError:
    """Blame the override when the person set the field, the template otherwise."""
    cls = InvalidOverride if field in overrides else NotServedHere
    return cls(f"{field}={show(value)}: {message}", field=field, value=value, fix=fix)


def _check_backend(template: TaskTemplate, overrides: dict) -> None:
    key = f"{template.placement}_{template.launch_mode}"
    if key in providers.REGISTRY:
        return
    modes = sorted(k[len(template.placement) + 1:] for k in providers.REGISTRY if k.startswith(template.placement + "_"))
    if modes:
        raise _error(overrides, "launch_mode", template.launch_mode,
                     f"placement {template.placement} has no provider for this launch mode",
                     f"use launch_mode {' or '.join(modes)} with placement {template.placement}")
    placements = [p for p in get_args(Placement) if any(k.startswith(p + "_") for k in providers.REGISTRY)]
    raise _error(overrides, "placement", template.placement, "no provider serves this placement",
                 f"use one of: {', '.join(placements)}")


def _check_gpu(settings: Settings, template: TaskTemplate, overrides: dict) -> None:
    gpu = template.resources.gpu
    if gpu.lower() == "any":
        return
    names = known_gpu_names()
    if template.placement == "ssh_rental":  # a rental box may hold a model the catalog lacks
        names = sorted(set(names) | {h.gpus.model for h in _inventory_or_none(settings)})
    if gpu.lower() in {n.lower() for n in names}:
        return
    field = "resources.gpu"
    try:
        family = gpu_family(gpu)  # a family (A100) or a vendor alias (h100-80gb) of catalog models
        fix = (f"name one model: {' or '.join(family)}" if len(family) > 1 else
               f"write {family[0]!r}, the catalog's name for {gpu!r} (offers are matched by that name)")
    except UnknownGpu:
        close = difflib.get_close_matches(gpu.upper(), names, n=3, cutoff=0.5)
        close += [n for n in names if n.upper().startswith(gpu.upper()) and n not in close]  # A100 -> both sizes
        fix = (f"did you mean {' or '.join(close[:3])}? " if close else "") + f"use 'any' or one of: {', '.join(names)}"
    raise _error(overrides, field, gpu, "not a GPU model of the catalog", fix)


def _check_store(settings: Settings, template: TaskTemplate, overrides: dict) -> None:
    if template.checkpoint.store != "s3":
        return
    if not settings.s3_configured:  # the settings read ORBIT_S3_CHECKPOINT_STORE, once
        raise _error(overrides, "checkpoint.store", "s3", "no S3 checkpoint store is configured",
                     "set ORBIT_S3_CHECKPOINT_STORE=s3://BUCKET/PREFIX (credentials: AWS's standard chain), "
                     "or use checkpoint.store=fs")


def _check_aws(settings: Settings, overrides: dict) -> None:
    if not re.fullmatch(AWS_REGION, settings.aws.region or ""):
        raise _error(overrides, "placement", "aws_spot", f"AWS region {show(settings.aws.region)} is not a region name",
                     "set ORBIT_AWS_REGION (or AWS_REGION) to a region such as us-east-1")
    method = aws_credential_source()
    if method is None:
        raise _error(overrides, "placement", "aws_spot", "no AWS credentials are configured",
                     "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / a shared credentials file "
                     "(boto3's chain; an EC2 instance role is not probed here, as that needs a network call)")


def aws_credential_source() -> str | None:
    """Which link of boto3's credential chain has credentials (`env`, `shared-credentials-file`,
    ...), or None. The links that ask a metadata server over the network (instance role,
    container role) are left out: a submission must not wait on, or reach, the network."""
    try:
        import botocore.session  # lazy: 0.4 s at every `orbit submit`; only an AWS template asks for credentials

        session = botocore.session.Session()
        resolver = session.get_component("credential_provider")
        for method in ("iam-role", "container-role"):
            resolver.remove(method)
        creds = resolver.load_credentials()
    except Exception:  # a broken profile or config file: reported as no credentials, with the fix
        return None
    return getattr(creds, "method", "unknown") if creds is not None else None


def _inventory_or_none(settings: Settings) -> list:
    try:
        return list(load_inventory(settings.ssh_hosts).hosts)
    except InventoryError:
        return []


def _check_ssh_hosts(settings: Settings, template: TaskTemplate, overrides: dict) -> None:
    inventory = load_inventory(settings.ssh_hosts)  # a missing or invalid inventory names its own fix
    docker = template.launch_mode == "docker_image"
    fitting = [h for h in inventory.hosts if h.fits(template.resources) and (h.docker or not docker)]
    if not fitting:
        r = template.resources
        want = f"{r.gpu_count}x {r.gpu} with >= {r.gpu_memory_gb:g} GB" + (" and docker: true" if docker else "")
        raise _error(overrides, "placement", "ssh_rental",
                     f"no host of the SSH inventory {settings.ssh_hosts} fits {want}",
                     f"add a host that fits to the inventory, or change resources "
                     f"(hosts: {', '.join(f'{h.name}: {h.gpus.count}x {h.gpus.model}' for h in inventory.hosts) or 'none'})")


def _check_group(settings: Settings, template: TaskTemplate, overrides: dict) -> None:
    """A job of several nodes: a store every node writes its shards into, and (SSH) enough hosts
    of one shape in one region. An AWS zone's capacity is learnt at dispatch, from its offers."""
    n = template.resources.nodes
    if template.launch_mode != "host_process":
        raise _error(overrides, "launch_mode", template.launch_mode,
                     f"a group of {n} nodes is started by torchrun on the hosts themselves",
                     "use launch_mode host_process with resources.nodes > 1")
    if template.placement != "sim" and template.checkpoint.store != "s3":
        # Sim hosts write into the control plane's own store; SSH and AWS hosts keep an `fs`
        # store on their own disks, where the other nodes' shards of a checkpoint never arrive.
        raise _error(overrides, "checkpoint.store", template.checkpoint.store,
                     f"a group of {n} nodes on {template.placement} needs a store every node writes its shards into",
                     "set checkpoint.store: s3 (with ORBIT_S3_CHECKPOINT_STORE=s3://...)")
    if template.placement == "ssh_rental":
        largest = load_inventory(settings.ssh_hosts).largest_group(template.resources)
        if largest < n:
            raise _error(overrides, "resources.nodes", n,
                         f"the SSH inventory {settings.ssh_hosts} has at most {largest} host{'' if largest == 1 else 's'} "
                         "of one shape in one region (a group is rented on hosts of one GPU model and count, in one region)",
                         f"add hosts of one shape and region to the inventory, or set resources.nodes to at most "
                         f"{max(largest, 1)}")

