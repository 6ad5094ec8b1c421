"""CDI's version table: the released versions, which version each field needs (CDI's own
MinimumRequiredVersion) and how versions compare. The codec (spec.py), the value rules (specrules.py), the
generator and validate all read versions here."""

from __future__ import annotations

from devinject.core.errors import SpecError

TYPE_CHECKING = False  # `typing` costs the hook ms per container start: type checkers only
if TYPE_CHECKING:
    from devinject.cdi.model import ContainerEdits, Spec

# Released CDI versions in order; what each adds is in docs/cdi-versions.md.
KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
DEFAULT_VERSION_CAP = "0.5.0"


def released_version(version: str) -> str | None:
    """`version` as CDI's version table names it, or None when it is no released version. The reference
    trims one leading `v` before it looks (specs-go/version.go `newVersion`): `v1.1.0` is 1.1.0 there."""
    plain = version[1:] if version.startswith("v") else version
    return plain if plain in KNOWN_VERSIONS else None


def version_key(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in version.split("."))
    except ValueError:
        raise SpecError(f"cdiVersion {version!r} is not a version number") from None


def _all_edits(spec: Spec) -> list[ContainerEdits]:
    return [spec.edits, *(d.edits for d in spec.devices)]


def version_needs(spec: Spec) -> list[tuple[str, str]]:
    """(version, what needs it) for every feature beyond CDI 0.3.0 the spec uses, newest first — the rules
    of CDI's own MinimumRequiredVersion."""
    edits = _all_edits(spec)
    rdts = [e.intel_rdt for e in edits if e.intel_rdt is not None]
    checks = (
        ("1.1.0", "netDevices", any(e.net_devices for e in edits)),
        ("1.1.0", "intelRdt.schemata or enableMonitoring",
         any(r.schemata is not None or r.enable_monitoring for r in rdts)),
        ("0.7.0", "intelRdt", bool(rdts)),
        ("0.7.0", "additionalGids", any(e.additional_gids for e in edits)),
        ("0.6.0", "annotations", bool(spec.annotations) or any(d.annotations for d in spec.devices)),
        ("0.6.0", "a '.' in the class", "." in spec.device_class),
        ("0.5.0", "a device name that starts with a digit",
         any(d.name[:1] and not d.name[:1].isalpha() for d in spec.devices)),
        ("0.5.0", "deviceNodes hostPath", any(n.host_path for e in edits for n in e.device_nodes)),
        ("0.4.0", "mounts type", any(m.type for e in edits for m in e.mounts)),
    )
    return [(version, what) for version, what, used in checks if used]


def required_version(spec: Spec) -> str:
    """The lowest CDI version whose fields admit everything this spec uses."""
    needs = version_needs(spec)
    return needs[0][0] if needs else "0.3.0"
