"""`validate`: CDI specs read the way CDI's reference library reads them — every released version (0.3.0 to
1.1.0) and every field those versions define, strict about unknown fields, types and values.

Every finding is a `Problem`: the file, the field in it (`devices[3].containerEdits.deviceNodes[0].permissions`),
the message and its severity; its text is `file: field: message`. A spec newer than what podman 4 and
containerd 1.7 read is valid, with a warning naming who cannot read it; `max_version` makes that an error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from devinject.cdi.cdiversion import DEFAULT_VERSION_CAP, KNOWN_VERSIONS, released_version, version_key
from devinject.cdi.identity import qualified
from devinject.cdi.model import Spec
from devinject.cdi.spec import list_spec_files, parse_spec_document, read_spec_text, spec_dir_problem, spec_from_dict
from devinject.cdi.specrules import spec_problems
from devinject.core.errors import SpecError, SpecValidationError

OLD_RUNTIMES = "podman 4.x and containerd 1.7"  # they refuse specs above 0.5.0
_FIELD = re.compile(r"[A-Za-z]\w*(?:\[\d+\])*(?:\.[A-Za-z]\w*(?:\[\d+\])*)*")  # devices[0].containerEdits


@dataclass(frozen=True)
class Problem:
    """One finding: in `file` (None: not about one file), at `field` of it (None: the file as a whole), and
    how bad: an `error` makes the file invalid, a `warning` (who cannot read it) does not."""

    file: str | None
    field: str | None
    message: str
    severity: str = "error"  # or "warning"

    def __str__(self) -> str:
        return ": ".join(part for part in (self.file, self.field, self.message) if part is not None)

    def as_json(self) -> dict[str, str | None]:
        return {"file": self.file, "field": self.field, "message": self.message, "severity": self.severity}


def _problem(file: str | None, text: str, severity: str = "error") -> Problem:
    """A problem from the spec rules' `field: message` text (a reader's error may name `file: ` first)."""
    if file is not None and text.startswith(file + ": "):
        text = text[len(file) + 2:]
    field, sep, message = text.partition(": ")
    if sep and _FIELD.fullmatch(field):
        return Problem(file, field, message, severity)
    return Problem(file, None, text, severity)


@dataclass(frozen=True)
class Validation:
    """The spec files read and every problem found, in the order found."""

    files: list[Path]
    problems: list[Problem]

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    def valid(self, file: Path) -> bool:
        return not any(p.file == str(file) for p in self.errors)


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


def hook_program_problem(path: str, local: str | None = None) -> str | None:
    """Why a spec's hook `path` (found here at `local`, default `path`) will not run, or will run what another
    user chose, as root: not absolute, missing (a runtime applying the spec then fails every container start:
    `fork/exec PATH: no such file or directory`), not an executable regular file, or someone else's or
    writable by group or others. None when it will run."""
    import os
    import stat

    from devinject.cdi.spec import trust_problem

    if not path.startswith("/"):
        return f"must be an absolute path, not {path!r}"
    here = local or path
    try:
        st = os.stat(here)
    except OSError as err:
        return f"{path}: {err.strerror.lower() if err.strerror else err} on this host: every container start " \
               "that applies this spec fails"
    if not stat.S_ISREG(st.st_mode) or not os.access(here, os.X_OK):
        return f"{path}: not an executable file: every container start that applies this spec fails"
    problem = trust_problem(st)
    if problem:
        return f"{path}: {problem}: it runs as root for every container that applies this spec"
    return None


def hook_problems(spec: Spec, local: object = None) -> list[str]:
    """`field: problem` for each hook of `spec` that will not run (hook_program_problem); `local` maps a hook
    path to where it is found here (None: where it is named)."""
    where = [("containerEdits", spec.edits)] + [(f"devices[{i}].containerEdits", d.edits)
                                                 for i, d in enumerate(spec.devices)]
    out = []
    seen: dict[str, str | None] = {}
    for prefix, edits in where:
        for i, hook in enumerate(edits.hooks):
            if hook.path not in seen:
                here = local(hook.path) if callable(local) else None
                seen[hook.path] = hook_program_problem(hook.path, here)
            if seen[hook.path] is not None:
                out.append(f"{prefix}.hooks[{i}].path: {seen[hook.path]}")
    return out


def validate_spec(spec: Spec, *, source: str) -> None:
    """Raise SpecValidationError unless `spec` is valid (generate calls this before any write)."""
    problems = spec_problems(spec)
    if problems:
        raise SpecValidationError([f"{source}: {p}" for p in problems])


def spec_files(paths: Iterable[str]) -> tuple[list[Path], list[Problem]]:
    """Files named, plus `*.yaml`/`*.json` regular files in directories named (not recursive, as CDI
    scans); and the problems of untrusted directories, whose files are refused."""
    files: list[Path] = []
    problems: list[Problem] = []
    for name in paths:
        path = Path(name)
        directory = name if path.is_dir() else str(path.parent)
        if not path.exists():
            raise SpecError(f"{path}: no such file or directory")
        problem = spec_dir_problem(directory)
        if problem:
            problems.append(_problem(directory, problem))
        elif path.is_dir():
            files += [Path(p) for p in list_spec_files(name)]
        else:
            files.append(path)
    return files, problems


def check_paths(paths: Iterable[str], *, max_version: str | None = None, node_local: bool = False) -> Validation:
    """Validate files and spec dirs; also flags one device defined twice at the same priority (same dir).
    Compatibility notes are warnings — or, with `max_version`, errors. A hook that cannot run on this machine
    is a node-local problem: an error for the node's own specs (`node_local`), a warning for a spec that may be
    made for another node (the CDI reference calls such a spec valid)."""
    if max_version is not None and max_version not in KNOWN_VERSIONS:
        raise SpecError(f"--max-version: {max_version!r} is not a released CDI version ({', '.join(KNOWN_VERSIONS)})")
    files, problems = spec_files(paths)
    owners: dict[tuple[Path, str], Path] = {}
    for file in files:
        name = str(file)
        try:
            data = parse_spec_document(read_spec_text(file), name)
        except SpecError as err:
            problems.append(_problem(name, str(err)))
            continue
        file_problems = document_problems(data)
        problems += [_problem(name, p) for p in file_problems]
        if file_problems:
            continue
        spec = spec_from_dict(data)
        problems += [_problem(name, p, "error" if node_local else "warning") for p in hook_problems(spec)]
        note = compatibility_warning(spec, max_version)
        if note:
            problems.append(_problem(name, note, "error" if max_version else "warning"))
        for i, device in enumerate(spec.devices):
            key = (file.parent.resolve(), qualified(spec.kind, device.name))
            if key in owners:
                problems.append(Problem(name, f"devices[{i}].name",
                                        f"{key[1]}: also defined in {owners[key]} at the same priority"))
            else:
                owners[key] = file
    return Validation(files, problems)


def validate_paths(paths: Iterable[str], *, max_version: str | None = None) -> tuple[list[Path], list[str]]:
    """`check_paths`'s files and errors as text (`file: field: message`), for callers that compare lines."""
    found = check_paths(paths, max_version=max_version)
    return found.files, [str(p) for p in found.errors]
