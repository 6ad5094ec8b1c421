"""A doctor link checked alone (`check_link`) reads the facts an earlier link learns (doctor.LinkFacts) from
that link, checked first, or says it needs it: the runtime link alone read no spec file and passed a runtime
that does not read the spec's dir (test_doctor.py's live host)."""

from __future__ import annotations

from devinject.api import LiveNode
from devinject.doctor import DoctorOptions, check_link
from tests.integration import test_doctor
from tests.integration.test_doctor import CONTAINERD, NAME, Live

live = test_doctor.live  # the live host fixture (pytest knows a fixture by the name it is bound to here)


def _runtime_alone(host: Live) -> tuple[bool | None, str]:
    node = LiveNode(str(host.root), state_dir=str(host.state))
    check = check_link(node, NAME, "runtime", DoctorOptions(spec_dirs=(str(host.cdi),)))
    return check.ok, check.detail


def test_the_runtime_link_alone_checks_the_dir_of_the_spec_link_s_file(live: Live) -> None:
    ok, detail = _runtime_alone(live)
    assert ok is True and detail.startswith(f"containerd applies CDI from {live.cdi} ("), detail
    live.containerd(CONTAINERD.format(cdi="/etc/cdi"))  # the runtime reads another dir than the spec's
    ok, detail = _runtime_alone(live)
    assert ok is False and detail.endswith(f"reads /etc/cdi, not {live.cdi}"), detail


def test_the_runtime_link_alone_says_it_needs_the_spec_link(live: Live) -> None:
    for spec in live.cdi.iterdir():
        spec.unlink()
    ok, detail = _runtime_alone(live)
    assert ok is False and detail == f"needs the spec link, which does not hold: no spec in {live.cdi} names {NAME}"
