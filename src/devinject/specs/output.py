"""The spec pipeline's last stage: a spec rendered (validated first) and written, atomically, with the
generation number of a directory `watch` manages."""

from __future__ import annotations

from pathlib import Path

from devinject.cdi.model import Spec
from devinject.cdi.spec import dump


def spec_filename(spec: Spec, fmt: str) -> str:
    return f"{spec.vendor}-{spec.device_class}.{fmt}"


def render(spec: Spec, fmt: str, generation: int | None = None) -> str:
    from devinject.specs.validate import validate_spec

    text = dump(spec, fmt, generation=generation)
    validate_spec(spec, source=spec_filename(spec, fmt))
    return text


def write_specs(specs: list[Spec], output_dir: Path, fmt: str, *, managed: bool = False,
                stale_kinds: tuple[str, ...] = ()) -> list[Path]:
    """Validate every spec first, then write each atomically: an invalid one writes nothing at all.

    In a directory `watch` manages (or with `managed`, which makes it one) the rewrite carries the
    directory's next generation number and never replaces a newer one, and specs of `stale_kinds` (no
    devices left) are removed. Anywhere else the files are a pure function of the specs.
    """
    from devinject.cdi.spec import write_atomic
    from devinject.linux.trusteddir import trusted_dir

    # specs are code the runtime runs as root: the directory made 0755 whatever the umask, or refused (one line)
    # when someone but root could change it or a directory above it (the hook would refuse its specs anyway)
    trusted_dir(str(output_dir), what="spec directory")
    rendered = {output_dir / spec_filename(spec, fmt): render(spec, fmt) for spec in specs}
    from devinject.specs import sequence as generation

    if managed or generation.managed(output_dir):
        stale = [output_dir / f"{kind.replace('/', '-')}.{fmt}" for kind in stale_kinds]
        generation.write_specs_generation(output_dir, rendered, stale)
    else:
        for path, text in rendered.items():
            write_atomic(path, text)
    return list(rendered)
