"""`validate`: CDI specs read the way CDI's reference library reads them — every released version (0.3.0 to
1.1.0) and every field those versions define, strict about unknown fields, types and values.

Every problem is reported as `file: devices[3].containerEdits.deviceNodes[0].permissions: message`.
A spec newer than what podman 4 and containerd 1.7 read is valid, with a warning naming who cannot read it;
`max_version` turns that into a problem.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from devinject.core.cdiversion import DEFAULT_VERSION_CAP, KNOWN_VERSIONS, released_version, version_key
from devinject.core.errors import SpecError, SpecValidationError
from devinject.core.identity import qualified
from devinject.core.model import Spec
from devinject.core.spec import list_spec_files, parse_spec_document, read_spec_text, spec_dir_problem, spec_from_dict
from devinject.core.specrules import spec_problems

OLD_RUNTIMES = "podman 4.x and containerd 1.7"  # they refuse specs above 0.5.0


def document_problems(data: object) -> list[str]:
    """The shape first (fields, types), then the values; paths relative to the document."""
    try:
        spec = spec_from_dict(data)
    except SpecError as err:
        return [str(err)]
    return spec_problems(spec)


def compatibility_warning(spec: Spec, max_version: str | None = None) -> str | None:
    """Who cannot read this spec: a note when it is newer than old runtimes read (or than `max_version`)."""
    limit = max_version or DEFAULT_VERSION_CAP
    version = released_version(spec.cdi_version)
    if version is not None and version_key(version) > version_key(limit):
        if max_version:
            return f"cdiVersion: {spec.cdi_version} is above the allowed {max_version}"
        return f"cdiVersion: {spec.cdi_version}: {OLD_RUNTIMES} cannot read it (they read up to {limit})"
    return None


def validate_spec(spec: Spec, *, source: str) -> None:
    """Raise SpecValidationError unless `spec` is valid (generate calls this before any write)."""
    problems = spec_problems(spec)
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


def validate_paths(paths: Iterable[str], *, max_version: str | None = None,
                   warnings: list[str] | None = None) -> tuple[list[Path], list[str]]:
    """Validate files and spec dirs; also flags one device defined twice at the same priority (same dir).
    Compatibility notes go to `warnings` — or, with `max_version`, are problems."""
    if max_version is not None and max_version not in KNOWN_VERSIONS:
        raise SpecError(f"--max-version: {max_version!r} is not a released CDI version ({', '.join(KNOWN_VERSIONS)})")
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
        note = compatibility_warning(spec, max_version)
        if note and max_version:
            problems.append(f"{file}: {note}")
        elif note and warnings is not None:
            warnings.append(f"{file}: {note}")
        for device in spec.devices:
            key = (file.parent.resolve(), qualified(spec.kind, device.name))
            if key in owners:
                problems.append(f"{file}: {key[1]}: also defined in {owners[key]} at the same priority")
            else:
                owners[key] = file
    return files, problems
