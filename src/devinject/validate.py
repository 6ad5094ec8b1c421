"""`validate`: the strict CDI 0.5.0 JSON schema plus the semantic rules CDI enforces in code.

Every problem is reported as `file: devices[3].containerEdits.deviceNodes[0].permissions: message`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from devinject.errors import SpecError, SpecValidationError
from devinject.model import ContainerEdits, Spec
from devinject.names import device_name_problem, kind_problem
from devinject.spec import (
    list_spec_files,
    parse_spec_document,
    read_spec_text,
    required_version,
    spec_dir_problem,
    spec_from_dict,
    spec_to_dict,
    version_key,
)

DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")


@cache
def _validator() -> Any:
    import jsonschema

    schema = json.loads(resources.files("devinject.schemas").joinpath("cdi-0.5.0.json").read_text())
    return jsonschema.Draft7Validator(schema)


def _path(parts: Iterable[object]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "spec"


def _edit_problems(edits: ContainerEdits, where: str) -> list[str]:
    problems = []
    for i, node in enumerate(edits.device_nodes):
        at = f"{where}.deviceNodes[{i}]"
        if not node.path.startswith("/"):
            problems.append(f"{at}.path: must be absolute")
        if node.type in ("b", "c") and (node.major is None) != (node.minor is None):
            problems.append(f"{at}: major and minor go together")
        if node.permissions and len(set(node.permissions)) != len(node.permissions):
            problems.append(f"{at}.permissions: repeated letters in {node.permissions!r}")
    for i, mount in enumerate(edits.mounts):
        if not mount.container_path.startswith("/"):
            problems.append(f"{where}.mounts[{i}].containerPath: must be absolute")
    for i, hook in enumerate(edits.hooks):
        if not hook.path.startswith("/"):
            problems.append(f"{where}.hooks[{i}].path: must be absolute")
    return problems


def semantic_problems(spec: Spec) -> list[str]:
    problems = []
    if (problem := kind_problem(spec.kind)) is not None:
        problems.append(f"kind: {problem}")
    needed = required_version(spec)
    if version_key(needed) > version_key(spec.cdi_version):
        problems.append(f"cdiVersion: {spec.cdi_version} is too low for the fields used (needs {needed})")
    seen: set[str] = set()
    for i, device in enumerate(spec.devices):
        at = f"devices[{i}]"
        if (problem := device_name_problem(device.name)) is not None:
            problems.append(f"{at}.name: {problem}")
        if device.name in seen:
            problems.append(f"{at}.name: device {device.name!r} defined twice")
        seen.add(device.name)
        if device.edits.is_empty():
            problems.append(f"{at}.containerEdits: empty device edits")
        problems += _edit_problems(device.edits, f"{at}.containerEdits")
    problems += _edit_problems(spec.edits, "containerEdits")
    return problems


def document_problems(data: object) -> list[str]:
    """Schema problems, then (when the shape is sound) semantic ones; paths relative to the document."""
    errors = sorted(_validator().iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
    problems = [f"{_path(e.absolute_path)}: {e.message}" for e in errors]
    if problems:
        return problems
    try:
        spec = spec_from_dict(data)
    except SpecError as err:
        return [str(err)]
    return semantic_problems(spec)


@cache
def _fast_validator() -> Any:
    """The same schema compiled to Python (fastjsonschema): a yes/no answer, much faster on big specs."""
    import fastjsonschema

    schema = json.loads(resources.files("devinject.schemas").joinpath("cdi-0.5.0.json").read_text())
    return fastjsonschema.compile(schema)


def validate_spec(spec: Spec, *, source: str) -> None:
    """Raise SpecValidationError unless `spec` is valid (generate calls this before any write).

    The compiled schema answers first; only a failing spec pays for jsonschema's precise messages.
    """
    import fastjsonschema

    data = spec_to_dict(spec)
    try:
        _fast_validator()(data)
        problems = semantic_problems(spec)
    except fastjsonschema.JsonSchemaException:
        problems = document_problems(data) or ["schema: rejected"]
    if problems:
        raise SpecValidationError([f"{source}: {p}" for p in problems])


def spec_files(paths: Iterable[str]) -> tuple[list[Path], list[str]]:
    """Files named, plus `*.yaml`/`*.json` regular files in directories named (not recursive, as CDI
    scans); and the problems of untrusted directories, whose files are refused."""
    files: list[Path] = []
    problems: list[str] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            problem = spec_dir_problem(name)
            if problem:
                problems.append(problem)
                continue
            files += [Path(p) for p in list_spec_files(name)]
        elif path.exists():
            problem = spec_dir_problem(str(path.parent))
            if problem:
                problems.append(problem)
                continue
            files.append(path)
        else:
            raise SpecError(f"{path}: no such file or directory")
    return files, problems


def validate_paths(paths: Iterable[str]) -> tuple[list[Path], list[str]]:
    """Validate files and spec dirs; also flags one device defined twice at the same priority (same dir)."""
    files, problems = spec_files(paths)
    owners: dict[tuple[Path, str], Path] = {}
    for file in files:
        try:
            data = parse_spec_document(read_spec_text(file), str(file))
        except SpecError as err:
            problems.append(str(err))
            continue
        file_problems = document_problems(data)
        problems += [f"{file}: {p}" for p in file_problems]
        if file_problems:
            continue
        spec = spec_from_dict(data)
        for device in spec.devices:
            key = (file.parent.resolve(), f"{spec.kind}={device.name}")
            if key in owners:
                problems.append(f"{file}: {key[1]}: also defined in {owners[key]} at the same priority")
            else:
                owners[key] = file
    return files, problems
