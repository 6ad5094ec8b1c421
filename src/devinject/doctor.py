"""`devinject doctor`: the chain a device goes through to reach a container, link by link, and the first one
that is broken with its fix.

The links, in order (each one needs the ones before it):
- `pci`: the function is in sysfs;
- `driver`: bound to the family's driver, its module loaded;
- `nodes`: its char nodes exist with the numbers the driver gave them;
- `libraries`: the driver's user-space files are found, of one version, the running module's;
- `spec`: a CDI spec in the spec dirs names it, is trusted and valid, matches discovery now, and its hooks run
  on this node;
- `runtime`: the runtime applies CDI from that spec's directory (or, for one that cannot, the hook is
  installed); pod annotations passed through to the OCI spec are flagged;
- `ledger`: free, or who holds it;
- `health`: the verdict and its reasons;
- `kubelet` (on a Kubernetes node): the device plugin registered for its kind, or the DRA driver registered;
- `slice` (when the API server is given: a kubeconfig or in-cluster credentials): the node's ResourceSlices of
  the DRA driver, as the scheduler sees them: there or not ("registered but no slices"), each pool complete,
  the device published, left out (held by the device plugin) or missing, and its taints, the slice's own and
  those an admin's DeviceTaintRule puts on it (resource.k8s.io v1, else v1beta2; neither served: skipped with
  a word); when slices are missing, what the driver's /metrics count of publishes the API server refused.

Every check but `slice` reads files under the node's root; `slice` makes one list call of the node's slices
and one of the DeviceTaintRules (dra/kubeapi.py: a deadline, a bounded answer) and one bounded GET of the
driver's /metrics, all shared by every device; each answer from a server has one wall-clock deadline from connect
to its last byte (core/deadline.SocketDeadline), which a server dripping its status line, headers or chunk sizes
cannot stretch. A link after a broken one is reported as not checked (`ok` null). A module of the top
(docs/architecture.md): it reads every layer's answers.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from devinject.cdi.identity import device_key
from devinject.core.asciitext import is_digits
from devinject.core.deadline import SocketDeadline
from devinject.core.errors import DevinjectError, SpecError
from devinject.core.paths import DEFAULT_SPEC_DIRS

if TYPE_CHECKING:
    from devinject.api import LiveNode
    from devinject.cdi.model import Device, Spec
    from devinject.discovery.discover import FoundDevice
    from devinject.discovery.nvml import GpuFacts
    from devinject.discovery.profiles import Profile
    from devinject.discovery.sysfs import PciDevice
    from devinject.runtimes.status import RuntimeStatus

LINKS = ("pci", "driver", "nodes", "libraries", "spec", "runtime", "ledger", "health", "kubelet", "slice")
KUBELET_DIR = "/var/lib/kubelet"
DRA_DRIVER = "dra.devinject.io"
_SO_VERSION = re.compile(r"\.so\.(\d+\.\d+(?:\.\d+)*)$")


@dataclass(frozen=True, slots=True)
class Check:
    link: str
    ok: bool | None  # None: not checked, a link before it is broken
    detail: str
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"link": self.link, "ok": self.ok, "detail": self.detail, "fix": self.fix}


@dataclass(frozen=True, slots=True)
class Diagnosis:
    name: str
    kind: str
    pci_address: str | None
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok is True for c in self.checks)

    @property
    def broken(self) -> Check | None:
        return next((c for c in self.checks if c.ok is False), None)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "pci_address": self.pci_address, "ok": self.ok,
                "checks": [c.to_json() for c in self.checks]}


class SliceLister(Protocol):
    """What the slice link asks of the API server (dra/kubeapi.ResourceApi)."""

    def list_resource_slice(self, field_selector: str) -> dict[str, Any]: ...

    def list_device_taint_rules(self, version: str) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    spec_dirs: tuple[str, ...] = DEFAULT_SPEC_DIRS
    runtime: str | None = None  # None: the runtimes whose config is on the node
    kubelet_dir: str = KUBELET_DIR
    hooks_dir: str | None = None
    runtime_version: str | None = None  # None: asked of the binary on the machine's own root, else unknown
    api: SliceLister | None = None  # the API server (dra/kubeapi.ResourceApi): None, the slice link is left out
    node_name: str = ""  # this node's name in the API (the slices' spec.nodeName)
    driver: str = DRA_DRIVER  # the DRA driver whose slices are read
    metrics_address: str | None = "127.0.0.1:9401"  # the DRA driver's /metrics (HOST:PORT), for refused publishes


class _Broken(Exception):
    """A link that does not hold: its detail and fix."""

    def __init__(self, detail: str, fix: str | None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.fix = fix


@dataclass
class LinkFacts:
    """What a link learnt that a later one reads, one typed field each (the link that sets it in a comment):
    a link that reads one is checked after that link, also when it is checked alone (`check_link`: NEEDS)."""

    spec_path: str | None = None  # spec: the file that names the device; runtime reads its directory

    def spec_dir(self) -> str:
        """The directory of the spec file that names the device (what the runtime link checks it reads)."""
        if self.spec_path is None:
            raise _Broken("needs the spec link's file: check the spec link first", None)
        return os.path.dirname(self.spec_path)


# link -> the links whose facts it reads (LinkFacts), checked before it when it is checked alone
NEEDS = {"runtime": ("spec",)}


@dataclass
class _Subject:
    """One device as the doctor walks it: discovered, or a function of a known family discovery did not offer."""

    name: str
    profile: Profile
    pci: PciDevice
    found: FoundDevice | None
    names: tuple[str, ...] = ()
    facts: LinkFacts = field(default_factory=LinkFacts)


def _subjects(node: LiveNode) -> list[_Subject]:
    from devinject.agent.health import unbound_functions
    from devinject.discovery.discover import family_of
    from devinject.discovery.profiles import select_profile
    from devinject.discovery.sysfs import scan_pci

    subjects = [_Subject(str(node.names(f)[0]), f.profile, f.pci, f,
                         tuple(str(n) for n in node.names(f, ("index", "uuid", "pci")))) for f in node.devices()]
    offered = {fn.address for f in node.devices() for fn in f.functions}
    functions = scan_pci(node.host)
    family: dict[str, list[str]] = {}  # kind -> its functions' addresses, bound or not: what indexes count
    for pci in functions:
        profile = select_profile(node.profiles, pci) or family_of(node.profiles, pci)
        if profile is not None:
            family.setdefault(profile.kind, []).append(pci.address)

    def missing(profile: Profile, pci: PciDevice) -> _Subject:
        key = device_key(profile.kind, pci.address)
        index = family[profile.kind].index(pci.address) if profile.group_by == "function" else None
        names = (key,) if index is None else (key, f"{profile.kind}={index}")
        return _Subject(key, profile, pci, None, names)

    for profile, pci in unbound_functions(node.host, node.profiles):
        subjects.append(missing(profile, pci))
    for pci in functions:
        chosen = select_profile(node.profiles, pci)
        if chosen is not None and pci.address not in offered and chosen.group_by == "function":
            subjects.append(missing(chosen, pci))
    return sorted(subjects, key=lambda s: (s.profile.kind, s.pci.address))


API_TIMEOUT, API_BUDGET = 5.0, 10.0  # seconds: one list call's attempt, and all its attempts
_SLICE_LOGS = "kubectl -n devinject-system logs ds/devinject-dra | grep -i resourceslice"
ApiObject = dict[str, Any]  # an object as the API server lists it (a ResourceSlice, a DeviceTaintRule)


def slice_api(kubeconfig: str | None, environ: dict[str, str] | None = None) -> SliceLister | None:
    """The API server the slice link asks, by the DRA driver's credential rules (dra/kubeapi.py): --kubeconfig,
    else $KUBECONFIG, else the pod's service account; None when none of them is given (the doctor reads the
    node alone: ~/.kube/config is not taken unasked). DevinjectError (one line) for credentials that cannot
    be used."""
    from devinject.dra import kubeapi

    env = dict(os.environ) if environ is None else environ
    in_cluster = bool(env.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(f"{kubeapi.SERVICE_ACCOUNT}/token")
    if not kubeconfig and not env.get("KUBECONFIG") and not in_cluster:
        return None
    try:
        creds = kubeapi.credentials(kubeconfig, env)
    except OSError as err:
        raise DevinjectError(f"--kubeconfig {kubeconfig or env.get('KUBECONFIG') or '(in-cluster)'}: "
                             f"{err.strerror}") from None
    return kubeapi.ResourceApi(creds, timeout=API_TIMEOUT, budget=API_BUDGET)


def check_link(node: LiveNode, device: str, link: str, options: DoctorOptions = DoctorOptions()) -> Check:
    """One link of the first device `device` names, checked whatever the links before it say (the walk stops
    at the first broken one). A link that reads what an earlier one learnt (runtime: the spec's dir) has
    that link checked first (NEEDS); when it does not hold, the link says so: it needs it."""
    if link not in LINKS:
        raise DevinjectError(f"no link {link!r} (links: {', '.join(LINKS)})")
    subject = _select(node, device)[0]
    context = _Context(node, options)
    try:
        for need in NEEDS.get(link, ()):
            try:
                getattr(context, need)(subject)
            except _Broken as err:
                raise _Broken(f"needs the {need} link, which does not hold: {err.detail}", err.fix) from None
        detail, fix = getattr(context, link)(subject)
    except _Broken as err:
        return Check(link, False, err.detail, err.fix)
    return Check(link, True, detail, fix)


def _select(node: LiveNode, device: str | None) -> list[_Subject]:
    subjects = _subjects(node)
    if device is not None:
        from devinject.discovery.resolve import UnknownDevice, resolve

        refusal: DevinjectError | None = None
        try:
            found = {id(f) for f in resolve(node, device).devices}
        except UnknownDevice as unknown:
            found, refusal = set(), unknown
        chosen = [s for s in subjects if (s.found is not None and id(s.found) in found)
                  or (s.found is None and device in (*s.names, s.pci.address))]  # bound to no driver
        if not chosen:
            raise refusal or DevinjectError(f"{device}: no device doctor can check under {node.root}")
        subjects = chosen
    return subjects


def diagnose(node: LiveNode, device: str | None = None, options: DoctorOptions = DoctorOptions()) -> list[Diagnosis]:
    """The chain of every device of the node (or of those `device` names: an index or CDI name, a UUID, a key
    `kind=PCI address`, a PCI address), in kind then address order."""
    context = _Context(node, options)
    return [context.walk(s) for s in _select(node, device)]


class _Context:
    """What every device's walk shares: the node's inventory, health, generated specs and spec files, read once."""

    def __init__(self, node: LiveNode, options: DoctorOptions) -> None:
        self.node = node
        self.options = options
        self._specs: dict[str, Spec] | None = None
        self._files: list[tuple[str, Spec | None, str | None]] | None = None
        self._health: dict[str, Any] | None = None
        self._inventory: dict[str, Any] | None = None
        self._slices: list[dict[str, Any]] | _Broken | None = None
        self._publish_errors: dict[str, float] | str | None = None  # str: why /metrics gave no answer
        self._taint_rules: tuple[list[dict[str, Any]], str] | None = None  # (rules, why none were read)

    def walk(self, subject: _Subject) -> Diagnosis:
        links = [("pci", self.pci), ("driver", self.driver), ("nodes", self.nodes), ("libraries", self.libraries),
                 ("spec", self.spec), ("runtime", self.runtime), ("ledger", self.ledger), ("health", self.health)]
        if self.node.host.is_dir(self.options.kubelet_dir):
            links.append(("kubelet", self.kubelet))
        if self.options.api is not None:
            links.append(("slice", self.slice))
        checks: list[Check] = []
        broken: str | None = None
        for link, check in links:
            if broken is not None:
                checks.append(Check(link, None, f"not checked: the {broken} link is broken"))
                continue
            try:
                detail, fix = check(subject)
            except _Broken as err:
                checks.append(Check(link, False, err.detail, err.fix))
                broken = link
                continue
            checks.append(Check(link, True, detail, fix))
        return Diagnosis(subject.name, subject.profile.kind, subject.pci.address, tuple(checks))

    # ---- links ----------------------------------------------------------------------------------------------

    def pci(self, s: _Subject) -> tuple[str, str | None]:
        path = f"/sys/bus/pci/devices/{s.pci.address}"
        if not self.node.host.is_dir(path):
            raise _Broken(f"{self.node.host.real(path)} is gone", "check the card is seated; rescan: echo 1 > "
                          f"{self.node.host.real('/sys/bus/pci/rescan')}")
        model = s.profile.model(s.pci) or "unknown model"
        gpu = self.node.gpu_facts(s.found) if s.found is not None else None
        return (f"{s.pci.address} {model} ({s.pci.vendor:04x}:{s.pci.device:04x}), NUMA node "
                f"{s.pci.numa_node if s.pci.numa_node >= 0 else 'unknown'}" + (_nvml_said(gpu) if gpu else ""), None)

    def driver(self, s: _Subject) -> tuple[str, str | None]:
        expected = "/".join(s.profile.drivers) or "any driver"
        module = s.profile.driver_module
        load = f"modprobe {module}; " if module else ""
        # the fixes write sysfs as this machine sees it: under --root, the root's own
        bind = self.node.host.real(f"/sys/bus/pci/drivers/{s.profile.drivers[0] if s.profile.drivers else 'DRIVER'}")
        unbind = self.node.host.real(f"/sys/bus/pci/devices/{s.pci.address}/driver/unbind")
        if s.pci.driver is None:
            raise _Broken(f"no driver bound (expected {expected})", f"{load}echo {s.pci.address} > {bind}/bind")
        if s.profile.drivers and s.pci.driver not in s.profile.drivers:
            raise _Broken(f"bound to {s.pci.driver}, not {expected}",
                          f"echo {s.pci.address} > {unbind}; {load}echo {s.pci.address} > {bind}/bind")
        if module and not self.node.host.is_dir(f"/sys/module/{module}"):
            raise _Broken(f"bound to {s.pci.driver}, but module {module} is not loaded", f"modprobe {module}")
        return f"bound to {s.pci.driver}" + (f" (module {module})" if module else ""), None

    def nodes(self, s: _Subject) -> tuple[str, str | None]:
        if s.found is None:
            raise _Broken(f"no device nodes found for {s.pci.address} (the profile's rules matched none)",
                          "the driver makes them: reload it, or udevadm trigger; for NVIDIA nvidia-modprobe -c "
                          "<minor>, then devinject create-dev-char-links")
        shown = []
        for dev in s.found.nodes:
            st = self.node.host.lstat(dev.path)
            real = self.node.host.real(dev.path)
            # the fixes name the node as this machine sees it: under --root, the root's own path
            if st is None:
                raise _Broken(f"{real} is missing", "the driver makes it: reload it, or udevadm trigger "
                              f"(mknod {real} c {dev.major} {dev.minor} by hand)")
            if not stat.S_ISCHR(st.st_mode):
                raise _Broken(f"{real} is not a char device", f"rm it and let the driver make it (mknod "
                              f"{real} c {dev.major} {dev.minor})")
            numbers = (os.major(st.st_rdev), os.minor(st.st_rdev))
            if numbers != (dev.major, dev.minor):
                raise _Broken(f"{real} is {numbers[0]}:{numbers[1]}, the driver's is {dev.major}:{dev.minor}",
                              f"rm {real}; mknod {real} c {dev.major} {dev.minor}")
            shown.append(f"{dev.path} {dev.major}:{dev.minor} {stat.S_IMODE(st.st_mode):04o}")
        return ", ".join(shown), None

    def _generated(self) -> dict[str, Spec]:
        if self._specs is None:
            from devinject.specs.generate import GenerateOptions

            specs = self.node.specs(GenerateOptions(strategies=("index", "uuid", "pci"),
                                                    hook_path="/usr/bin/devinject"))
            self._specs = {spec.kind: spec for spec in specs}
        return self._specs

    def libraries(self, s: _Subject) -> tuple[str, str | None]:
        declared = bool(s.profile.libraries or s.profile.driver_libraries)
        spec = self._generated().get(s.profile.kind)
        mounts = [m.host_path for m in spec.edits.mounts] if spec is not None else []
        libraries = [p for p in mounts if ".so" in os.path.basename(p)]
        if not declared:
            return "none needed (the family's profile lists no user-space files)", None
        if not libraries:
            raise _Broken("no user-space driver library found (ld.so.cache and the library dirs under the root)",
                          "install the driver's user-space package, then run ldconfig")
        versions = sorted({m.group(1) for p in libraries if (m := _SO_VERSION.search(p)) and m.group(1).count(".")})
        from devinject.specs.generate import driver_version

        running = driver_version(self.node.host, s.profile, [])
        if len(versions) > 1:
            raise _Broken(f"libraries of {len(versions)} driver versions: {', '.join(versions)}",
                          "remove the old driver's libraries (the package manager's leftovers), then ldconfig")
        if running and versions and versions[0] != running:
            raise _Broken(f"libraries are {versions[0]}, the running module is {running}",
                          "reboot into the installed driver, or install the user-space files of the running one")
        return f"{len(libraries)} files" + (f", version {versions[0]}" if versions else ""), None

    def _spec_files(self) -> list[tuple[str, Spec | None, str | None]]:
        """(file, its spec or None, its problem) for every spec file of the spec dirs."""
        if self._files is None:
            from devinject.cdi.spec import list_spec_files, load_text, read_spec_text, spec_dir_problem

            self._files = []
            for directory in self.options.spec_dirs:
                if not os.path.isdir(directory):
                    continue
                problem = spec_dir_problem(directory)
                if problem:
                    self._files.append((directory, None, problem))
                    continue
                for path in list_spec_files(directory):
                    try:
                        self._files.append((path, load_text(read_spec_text(path), path), None))
                    except SpecError as err:
                        self._files.append((path, None, err.message))
        return self._files

    def spec(self, s: _Subject) -> tuple[str, str | None]:
        dirs = ", ".join(self.options.spec_dirs)
        generate = "devinject generate (or run the agent: devinject watch / device-plugin)"
        named: list[tuple[str, Device]] = []
        for path, spec, problem in self._spec_files():
            if spec is None:
                if problem and (os.path.isdir(path) or s.profile.kind.replace("/", "-") in os.path.basename(path)):
                    raise _Broken(problem, f"devinject validate {path}; then {generate}")
                continue
            if spec.kind != s.profile.kind:
                continue
            named += [(path, d) for d in spec.devices if f"{spec.kind}={d.name}" in s.names]
        if not named:
            raise _Broken(f"no spec in {dirs} names {s.name}", generate)
        last_dir = os.path.dirname(named[-1][0])  # the last directory wins, as CDI reads them
        named = [n for n in named if os.path.dirname(n[0]) == last_dir]
        path, device = min(named, key=lambda n: s.names.index(f"{s.profile.kind}={n[1].name}"))
        s.facts.spec_path = path
        now = self._generated().get(s.profile.kind)
        fresh = next((d for d in now.devices if d.name == device.name), None) if now is not None else None
        if fresh is not None:
            had = {(n.path, n.major, n.minor) for n in device.edits.device_nodes}
            has = {(n.path, n.major, n.minor) for n in fresh.edits.device_nodes}
            if had != has:
                raise _Broken(f"{path}: stale: {device.name}'s nodes are not the ones discovered now "
                              f"({', '.join(sorted(p for p, _, _ in has ^ had))})", generate)
        from devinject.core.errors import ResolveError
        from devinject.hook.registry import Registry

        try:  # the hook's own registry: what a runtime resolves (a name defined twice at one priority: none)
            Registry(tuple(self.options.spec_dirs)).resolve((f"{s.profile.kind}={device.name}",))
        except (ResolveError, SpecError) as err:
            raise _Broken(err.message, f"devinject cdi list --spec-dir {last_dir}; remove the other file, then "
                          "devinject validate") from None
        spec = next(sp for p, sp, _ in self._spec_files() if p == path and sp is not None)
        for hook in (*spec.edits.hooks, *device.edits.hooks):
            if not os.access(hook.path, os.X_OK) and not os.access(self.node.host.real(hook.path), os.X_OK):
                raise _Broken(f"{path}: its {hook.hook_name} hook {hook.path} cannot run on this node",
                              f"{generate} with --hook-path of a devinject here (or --node-hook)")
        return f"{path} names {s.profile.kind}={device.name}, fresh, hooks runnable", None

    def runtime(self, s: _Subject) -> tuple[str, str | None]:
        from devinject.runtimes.status import runtime_status

        status = runtime_status(self.node.root, self.options.runtime, hooks_dir=self.options.hooks_dir,
                                version=self.options.runtime_version)
        spec_dir = s.facts.spec_dir()
        if not status.applies:
            raise _Broken(status.detail, self._configure_fix(status, (), spec_dir) or status.fix)
        if status.spec_dirs is not None and not any(
                os.path.realpath(spec_dir) == os.path.realpath(d) for d in status.spec_dirs):
            fix = (status.spec_dir_fix.replace("{spec_dir}", spec_dir) if status.spec_dir_fix else
                   self._configure_fix(status, status.spec_dirs, spec_dir)
                   or f"devinject runtime configure --runtime {status.runtime} --spec-dir {spec_dir}")
            raise _Broken(f"{status.detail}, but reads {', '.join(status.spec_dirs)}, not {spec_dir}", fix)
        if status.warning:
            return f"{status.detail}; warning: {status.warning}", status.warning_fix
        return status.detail, None

    def _configure_fix(self, status: RuntimeStatus, reads: tuple[str, ...], spec_dir: str | None) -> str | None:
        """The runtime's `runtime configure` line with the dirs it reads now (another agent's specs, the DRA
        driver's, may be there) and devinject's, then its restart; None where the runtime names none."""
        if status.configure is None:
            return None
        dirs = dict.fromkeys((*reads, *((spec_dir,) if spec_dir else self.options.spec_dirs)))
        restart = f", then {status.restart}" if status.restart else ""
        return f"{status.configure} {' '.join(f'--spec-dir {d}' for d in dirs)}{restart}"

    def _rows(self) -> dict[str, Any]:
        if self._inventory is None:
            self._inventory = {device_key(r.kind, r.pci_address): r for r in self.node.inventory()
                               if r.pci_address is not None}
        return self._inventory

    def ledger(self, s: _Subject) -> tuple[str, str | None]:
        key = device_key(s.profile.kind, s.pci.address)
        try:
            row = self._rows().get(key)
        except DevinjectError as err:
            raise _Broken(f"the ledger cannot be read: {err.message}",
                          "devinject list -v -v; a corrupt ledger is rebuilt by the next hook or agent") from None
        if row is not None and row.sharing == "time-slicing" and row.replicas:
            # a container beyond its replicas is refused by the ledger: say how many are there
            pods_only = ("dra-claim:", "device-plugin:")  # bookings for pods, not containers
            containers = [h for h in row.holders if not str(h.container or "").startswith(pods_only)]
            names = ", ".join(f"{h.container} (pid {h.pid})" for h in containers) or "none"
            full = (f"; full: another container is refused ('time-sliced {row.replicas} ways') until one ends"
                    if len(containers) >= row.replicas else "")
            return (f"time-sliced {row.replicas} ways by the device plugin, {len(containers)} held: {names}{full}"
                    f"; devinject who {s.name}"), None
        sharing = row.sharing if row is not None else s.profile.sharing
        if row is None or not row.holders:
            return f"free ({sharing})", None
        held = ", ".join(f"{h.container or '?'} (pid {h.pid}, {h.state})" for h in row.holders)
        return f"held by {held} ({sharing}); devinject who {s.name}", None

    def health(self, s: _Subject) -> tuple[str, str | None]:
        if self._health is None:
            self._health = {v.key: v for v in self.node.health()}
        verdict = self._health.get(device_key(s.profile.kind, s.pci.address))
        if verdict is None:
            return "not checked", None
        reasons = "; ".join(verdict.reasons)
        if verdict.health == "unhealthy":
            raise _Broken(f"unhealthy: {reasons}", f"once it is fixed (a reset, a reseat): devinject put-back "
                          f"{s.name}; its history: devinject events {s.pci.address}")
        return verdict.health + (f": {reasons}" if reasons else ""), None

    def kubelet(self, s: _Subject) -> tuple[str, str | None]:
        base = self.options.kubelet_dir
        plugin = self._plugin_socket(s)
        driver = self.options.driver
        dra = f"{base}/plugins_registry/{driver}-reg.sock"
        for path, what, daemonset in ((plugin, "device plugin", "devinject"),
                                      (dra, f"DRA driver {driver}", "devinject-dra")):
            real = self.node.host.real(path)
            if os.path.lexists(real):
                if not _answers(real):
                    raise _Broken(f"{real}: the {what}'s socket is there but nothing answers on it (it is not "
                                  "running)", f"start the {what}: kubectl -n devinject-system get pods -o wide; "
                                  f"kubectl -n devinject-system logs ds/{daemonset}")
                slices = ("" if daemonset != "devinject-dra" else "; its slices: the slice link below"
                          if self.options.api is not None else "; its slices: devinject doctor --kubeconfig FILE "
                          f"(or kubectl get resourceslices --field-selector spec.driver={driver})")
                return f"the {what} is registered ({real}){slices}", None
        raise _Broken(f"no devinject plugin registered with the kubelet for {s.profile.kind} (neither {plugin} "
                      f"nor {dra})", "start the device plugin (kubectl apply -k deploy/kubernetes: ds/devinject) or "
                      f"the DRA driver {driver} (kubectl apply -k deploy/kubernetes/dra: ds/devinject-dra), then "
                      "see that its DaemonSet selects this node (docs/deploy.md)")

    # ---- the node's ResourceSlices, as the API server has them -----------------------------------------------

    def _node_slices(self) -> list[dict[str, Any]]:
        """The API's slices of this node and driver, listed once for every device's walk."""
        if self._slices is None:
            from devinject.dra.kubeapi import ApiError

            assert self.options.api is not None
            selector = f"spec.nodeName={self.options.node_name},spec.driver={self.options.driver}"
            try:
                items = self.options.api.list_resource_slice(field_selector=selector).get("items")
                self._slices = [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []
            except ApiError as err:
                self._slices = _Broken(f"cannot list the node's ResourceSlices: {err.reason}", _api_fix(err.status))
        if isinstance(self._slices, _Broken):
            raise _Broken(self._slices.detail, self._slices.fix)
        return self._slices

    def _rules(self) -> tuple[list[dict[str, Any]], str]:
        """The cluster's DeviceTaintRules, listed once for every device's walk: (rules, '') or ([], why none
        were read: a clause). resource.k8s.io v1 (1.37), else v1beta2 (1.36, behind DRADeviceTaintRules)."""
        if self._taint_rules is None:
            from devinject.dra.kubeapi import ApiError

            assert self.options.api is not None
            self._taint_rules = ([], "DeviceTaintRules not checked: the API server serves them in neither "
                                     f"resource.k8s.io {' nor '.join(TAINT_RULE_VERSIONS)} (the "
                                     "DRADeviceTaintRules gate)")
            for version in TAINT_RULE_VERSIONS:
                try:
                    items = self.options.api.list_device_taint_rules(version).get("items")
                except ApiError as err:
                    if err.status == 404:
                        continue
                    self._taint_rules = ([], f"DeviceTaintRules not checked: {err.reason}")
                    break
                self._taint_rules = ([i for i in items if isinstance(i, dict)] if isinstance(items, list) else [],
                                     "")
                break
        return self._taint_rules

    def _refused(self) -> str:
        """What the DRA driver's /metrics count of its failed publishes, as a clause ('' when none or when
        nothing answers there)."""
        if self._publish_errors is None:
            address = self.options.metrics_address
            try:
                self._publish_errors = publish_errors(address) if address else {}
            except MetricsUnanswered as err:
                self._publish_errors = err.message
        counts = self._publish_errors
        if isinstance(counts, str):
            return f"; the driver's /metrics ({self.options.metrics_address}): {counts}"
        if not counts:
            return ""
        said = ", ".join(f"{reason} {count:g}" for reason, count in sorted(counts.items()))
        refused = any(reason.startswith("api-4") for reason in counts)
        return (f"; the driver's /metrics ({self.options.metrics_address}) count failed publishes: {said}"
                + ("; the API server refused its slices (an api-4xx: the driver's log has the server's message)"
                   if refused else ""))

    def _plugin_holder(self, s: _Subject) -> str | None:
        """Who holds the device through the device plugin (the ledger's booking), if it does: the DRA driver
        leaves such a device out of its slices until it is released."""
        if s.found is None or not self.node.state_dir:
            return None
        from devinject.cdi.identity import node_id_of
        from devinject.nodestate.clashrule import describe
        from devinject.nodestate.ledger import Ledger, is_plugin

        mine: set[str] = {node_id_of(n) for n in s.found.nodes if n.major is not None and n.minor is not None}
        for booking, entry in (Ledger(self.node.state_dir).read() or {}).items():
            if is_plugin(entry) and entry.holds(mine):
                return describe(booking, entry)
        return None

    def slice(self, s: _Subject) -> tuple[str, str | None]:
        from devinject.dra.slices import label, pool_name

        driver, node_name = self.options.driver, self.options.node_name
        items = self._node_slices()
        if not items:
            return self._no_slices(s)
        pool = pool_name(node_name, s.profile.kind)
        current, where = self._current_pool(s, items, pool)
        name = f"{label(s.profile.kind.partition('/')[2])}-{label(s.pci.address)}"  # dra/slices.py device_name
        devices = [(str(i.get("metadata", {}).get("name")), d) for i in current
                   for d in _spec(i).get("devices", []) or [] if isinstance(d, dict)]
        published = next(((slice_name, d) for slice_name, d in devices if d.get("name") == name), None)
        if published is None:
            holder = self._plugin_holder(s)
            if holder is not None:
                return (f"{name} is not in {where}: the device plugin holds it ({holder}); it is published again "
                        "when released"), None
            listing = f"kubectl get resourceslices --field-selector spec.nodeName={node_name},spec.driver={driver}"
            raise _Broken(f"{name} is not in {where} ({len(devices)} devices){self._refused()}",
                          f"the driver publishes what it discovers within its --rescan: {listing} -o yaml; "
                          f"{_SLICE_LOGS}")
        slice_name, device = published
        return self._untainted(s, pool, where, slice_name, device, len(devices))

    def _no_slices(self, s: _Subject) -> tuple[str, None]:
        """The node has no slice of the driver: fine where the device plugin serves the kind instead."""
        driver, node_name = self.options.driver, self.options.node_name
        registered = os.path.lexists(self.node.host.real(f"{self.options.kubelet_dir}/plugins_registry/"
                                                         f"{driver}-reg.sock"))
        plugin = self.node.host.real(self._plugin_socket(s))
        if not registered and os.path.lexists(plugin):
            return (f"no ResourceSlice of {driver} for node {node_name}: the DRA driver does not run here "
                    f"(the device plugin serves {s.profile.kind})"), None
        said = "the DRA driver is registered with the kubelet, but " if registered else ""
        raise _Broken(f"{said}the API server has no ResourceSlice of {driver} for node {node_name}"
                      + self._refused(),
                      f"{_SLICE_LOGS}; the driver's --node-name must be this node's name in the API ({node_name}: "
                      "kubectl get nodes) and its service account may create resourceslices "
                      "(deploy/kubernetes/dra/rbac.yaml)")

    def _current_pool(self, s: _Subject, items: list[ApiObject], pool: str) -> tuple[list[ApiObject], str]:
        """The slices of the pool's latest generation, and words for it; broken where the node's slices have
        no such pool or the generation is incomplete."""
        mine = [i for i in items if _spec(i).get("pool", {}).get("name") == pool]
        if not mine:
            pools = sorted({str(_spec(i).get("pool", {}).get("name")) for i in items})
            raise _Broken(f"the node's slices of {self.options.driver} have no pool {pool} (pools: "
                          f"{', '.join(pools)}): the driver does not offer {s.profile.kind}",
                          f"its --kind (the DaemonSet's ConfigMap) must include {s.profile.kind}; {_SLICE_LOGS}")
        generation = max(_int(_spec(i)["pool"].get("generation")) for i in mine)
        current = [i for i in mine if _int(_spec(i)["pool"].get("generation")) == generation]
        expected = max(_int(_spec(i)["pool"].get("resourceSliceCount")) for i in current)
        where = f"pool {pool} at generation {generation}"
        if len(current) < expected:
            raise _Broken(f"{where} is incomplete: {len(current)} of its {expected} slices (the scheduler "
                          "allocates from a complete pool only)" + self._refused(),
                          f"the driver is still publishing, or the API server refused a slice: {_SLICE_LOGS}")
        return current, where

    def _untainted(self, s: _Subject, pool: str, where: str, slice_name: str, device: ApiObject,
                   count: int) -> tuple[str, None]:
        """The published device holds unless it, or a DeviceTaintRule with an effect, taints it."""
        name = str(device.get("name"))
        taints = [t for t in device.get("taints", []) or [] if isinstance(t, dict)]
        rules, unread = self._rules()
        ruled = [(str(r.get("metadata", {}).get("name")), _spec(r)["taint"]) for r in rules
                 if rule_selects(r, self.options.driver, pool, name) and isinstance(_spec(r).get("taint"), dict)]
        if taints or any(t.get("effect") != "None" for _, t in ruled):
            said = "; ".join([_taint(t) for t in taints] + [f"{_taint(t)} by DeviceTaintRule {rule}"
                                                            for rule, t in ruled])
            fixes = [f"once the fault is fixed: devinject put-back {s.name} (the taint goes with the health "
                     "verdict)"] if taints else []
            if ruled:
                fixes.append("an admin's rule: once the device is back in service, kubectl delete devicetaintrule "
                             + " ".join(sorted({rule for rule, _ in ruled})))
            raise _Broken(f"{name} in {slice_name} ({where}) is tainted: {said}",
                          "no new claim gets it (NoExecute also evicts its pods); " + "; ".join(fixes))
        noted = "".join(f"; {_taint(t)} by DeviceTaintRule {rule} (no effect on scheduling)" for rule, t in ruled)
        return (f"{name} published in {slice_name} ({where}, {count} devices), no taint{noted}"
                + (f"; {unread}" if unread else "")), None

    def _plugin_socket(self, s: _Subject) -> str:
        """The device plugin's endpoint for the kind's resource (deviceplugin/agent.py's endpoint_for)."""
        from devinject.nodestate.profilefacts import served_resources

        resource = served_resources(self.node.state_dir).get(s.profile.kind, s.profile.kind) \
            if self.node.state_dir else s.profile.kind  # renamed when time-sliced (<kind>.shared)
        return f"{self.options.kubelet_dir}/device-plugins/devinject-{resource.replace('/', '-')}.sock"


TAINT_RULE_VERSIONS = ("v1", "v1beta2")  # resource.k8s.io's DeviceTaintRule: GA in 1.37, beta (off) in 1.36


def rule_selects(rule: dict[str, Any], driver: str, pool: str, device: str) -> bool:
    """Whether a DeviceTaintRule's spec.deviceSelector selects the device: each of driver, pool and device
    it sets equal; an empty selector selects every device, none selects nothing (the API's rule)."""
    selector = _spec(rule).get("deviceSelector")
    if not isinstance(selector, dict):
        return False
    return all(selector.get(field) in (None, want)
               for field, want in (("driver", driver), ("pool", pool), ("device", device)))


def _taint(taint: dict[str, Any]) -> str:
    """A taint as kubectl writes one: key[=value]:effect, and since when."""
    return (f"{taint.get('key')}" + (f"={taint['value']}" if taint.get("value") else "") + f":{taint.get('effect')}"
            + (f" since {taint['timeAdded']}" if taint.get("timeAdded") else ""))


def _spec(item: dict[str, Any]) -> dict[str, Any]:
    spec = item.get("spec")
    return spec if isinstance(spec, dict) else {}


def _int(value: object) -> int:
    try:
        return int(value)  # type: ignore[call-overload, no-any-return]
    except (TypeError, ValueError):
        return 0


def _api_fix(status: int) -> str:
    if status == 401:
        return "the API server refuses these credentials: check --kubeconfig's user (or the pod's token)"
    if status == 403:
        return ("the identity may not list resourceslices: kubectl auth can-i list resourceslices.resource.k8s.io "
                "(deploy/kubernetes/dra/rbac.yaml grants it to the driver's service account)")
    if status == 404:
        return "the API server serves no resource.k8s.io/v1 (Kubernetes 1.34 or later: docs/deploy.md)"
    return "kubectl cluster-info (with the same --kubeconfig); the API server must answer within its deadline"


METRICS_TIMEOUT = 2.0  # seconds for the DRA driver's /metrics, connect to last byte
METRICS_MAX = 1 << 20  # bytes of it read at most
_PUBLISH_ERRORS = re.compile(r'^devinject_dra_slice_publish_errors_total\{reason="([a-z0-9-]+)"\} ([0-9.e+]+)$')


class MetricsUnanswered(DevinjectError):
    """The driver's /metrics gave no whole answer within its deadline: one line saying so."""


def publish_errors(address: str, timeout: float = METRICS_TIMEOUT, limit: int = METRICS_MAX) -> dict[str, float]:
    """The DRA driver's count of failed publishes by reason (`api-422`, `unreachable`: dra/metrics.py), the
    nonzero ones, from its /metrics at HOST:PORT; {} when nothing listens there or it answers no 200. One
    deadline of `timeout` seconds from connect to the last byte: MetricsUnanswered when it passes first
    (whatever came before it is not counted: a server dripping bytes could otherwise hold doctor, or fake the
    counts, as long as it likes; port 9401 is anyone's while the driver is down)."""
    import http.client

    host, _, port = address.rpartition(":")
    if not is_digits(port):
        return {}
    deadline = SocketDeadline(timeout)
    connection = http.client.HTTPConnection(host.strip("[]") or "127.0.0.1", int(port), timeout=timeout)
    try:
        connection.connect()
        if connection.sock is not None:
            deadline.arm(connection.sock)
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        data = response.read(limit + 1) if response.status == 200 else b""  # bounded: what lies past it is cut
    except (OSError, ValueError, http.client.HTTPException):
        if deadline.passed():
            raise MetricsUnanswered(f"no whole answer within {timeout:g}s; not counted") from None
        return {}  # nothing listens there (the driver is not running), or no HTTP
    finally:
        deadline.disarm()
        connection.close()
    if deadline.expired:  # the watchdog shut the socket: what was read is cut short
        raise MetricsUnanswered(f"no whole answer within {timeout:g}s; not counted")
    counts = {}
    for line in data[:limit].decode("utf-8", "replace").splitlines():
        match = _PUBLISH_ERRORS.match(line)
        if match and float(match[2]) > 0:
            counts[match[1]] = float(match[2])
    return counts


def _answers(path: str) -> bool:
    """Something listens on the unix socket at `path` (a connect within a second)."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(1.0)
    try:
        client.connect(path)
        return True
    except OSError:
        return False
    finally:
        client.close()


def _nvml_said(gpu: GpuFacts) -> str:
    """`; NVML: Hopper, compute capability 9.0, 81559MiB, MIG off`: what NVML says of a GPU, as far as it does."""
    said = [gpu.architecture or "",
            f"compute capability {gpu.cuda_compute_capability}" if gpu.cuda_compute_capability else "",
            f"{gpu.memory_bytes // (1024 * 1024)}MiB" if gpu.memory_bytes else "",
            "" if gpu.mig_mode is None else "MIG on" if gpu.mig_mode else "MIG off"]
    profiles = [m.profile or f"gi{m.gpu_instance}-ci{m.compute_instance}" for m in gpu.mig_devices]
    if profiles:
        said.append("MIG devices " + ", ".join(profiles))
    return "; NVML: " + ", ".join(filter(None, said))


def render(diagnoses: list[Diagnosis]) -> str:
    """One line per link of each device, the fix under a broken one."""
    lines = []
    mark = {True: "ok  ", False: "FAIL", None: "-   "}
    for d in diagnoses:
        lines.append(d.name)
        for c in d.checks:
            lines.append(f"  {mark[c.ok]} {c.link:9} {c.detail}")
            if c.fix and c.ok is not None:
                lines.append(f"       {'':9} fix: {c.fix}")
    return "\n".join(lines) + "\n"
