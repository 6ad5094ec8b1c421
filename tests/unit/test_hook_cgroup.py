from devinject.hook.bpf import decode_rules, encode_prefix, insn
from devinject.hook.plan import AllowDevice
from devinject.linux.devcgroup import find_device_cgroup
from devinject.linux.mountinfo import parse_mountinfo

HYBRID = """\
25 31 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
26 25 0:24 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:8 - tmpfs tmpfs ro,mode=755
27 26 0:25 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
33 26 0:31 / /sys/fs/cgroup/devices rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,devices
34 26 0:32 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,memory
"""
PROC_CGROUP_V1 = "12:memory:/runc/c1\n5:devices:/runc/c1\n0::/runc/c1\n"
UNIFIED = HYBRID + "90 26 0:25 / /sys/fs/cgroup rw,relatime - cgroup2 none rw\n"
NESTED_ROOT = "40 30 0:31 /kubepods /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n"


def test_hybrid_host_uses_v1_devices_hierarchy():
    cgroup = find_device_cgroup(HYBRID, PROC_CGROUP_V1)
    assert (cgroup.version, cgroup.path) == (1, "/sys/fs/cgroup/devices/runc/c1")


def test_cgroup2_on_sys_fs_cgroup_means_v2_even_with_v1_lines():
    cgroup = find_device_cgroup(UNIFIED, "5:devices:/\n0::/test3\n")
    assert (cgroup.version, cgroup.path) == (2, "/sys/fs/cgroup/test3")


def test_mount_root_is_stripped_from_the_path():
    cgroup = find_device_cgroup(NESTED_ROOT, "5:devices:/kubepods/pod1/c1\n")
    assert cgroup.path == "/sys/fs/cgroup/devices/pod1/c1"


def test_no_device_controller():
    assert find_device_cgroup("", "0::/x\n") is None


def _busy_node(cgroup_lines: str) -> str:
    """A node running many containers: thousands of overlay and tmpfs mounts around the cgroup ones."""
    others = [f"{1000 + i} 27 0:{100 + i} / /run/containerd/c{i}/rootfs rw,relatime - overlay overlay rw,lowerdir=/l{i}"
              for i in range(3000)]
    others += [f"{5000 + i} 27 0:{4000 + i} / /sys/fs/cgroup/x{i} rw - tmpfs shm rw" for i in range(10)]
    return "\n".join(others[:1500]) + "\n" + cgroup_lines + "\n".join(others[1500:]) + "\n"


def test_the_device_cgroup_is_found_among_thousands_of_other_mounts():
    cgroup = find_device_cgroup(_busy_node(HYBRID), PROC_CGROUP_V1)
    assert (cgroup.version, cgroup.path) == (1, "/sys/fs/cgroup/devices/runc/c1")
    cgroup = find_device_cgroup(_busy_node(UNIFIED), "5:devices:/\n0::/test3\n")
    assert (cgroup.version, cgroup.path) == (2, "/sys/fs/cgroup/test3")
    # whatever is mounted last on /sys/fs/cgroup decides, cgroup or not: a tmpfs over cgroup2 is not v2
    hidden = _busy_node(UNIFIED + "91 26 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n")
    cgroup = find_device_cgroup(hidden, PROC_CGROUP_V1)
    assert (cgroup.version, cgroup.path) == (1, "/sys/fs/cgroup/devices/runc/c1")


def test_mountinfo_looks_up_one_mount_by_its_id():
    text = _busy_node(HYBRID)
    (entry,) = parse_mountinfo(text, mount_id="33")  # not 3300-something, whose ids start the same
    assert (entry.mount_point, entry.shared) == ("/sys/fs/cgroup/devices", True)
    assert parse_mountinfo(text, mount_id="99999") == []
    assert len(parse_mountinfo(text)) == 3010 + 5


def test_mountinfo_unescapes_spaces():
    (entry,) = parse_mountinfo("1 0 0:1 / /mnt/with\\040space rw - ext4 /dev/x rw\n")
    assert entry.mount_point == "/mnt/with space"


# Golden instruction bytes: each struct bpf_insn is code, dst|src<<4, off (s16), imm (s32), little-endian.
GOLDEN_ONE_RULE = bytes.fromhex(
    "b700000069766564"  # r0 = MARKER
    "b700000001000000"  # r0 = 1 (rule count)
    "6112000000000000"  # r2 = *(u32 *)(r1 + 0)
    "bf23000000000000"  # r3 = r2
    "54020000ffff0000"  # w2 &= 0xffff
    "7703000010000000"  # r3 >>= 16
    "6114040000000000"  # r4 = *(u32 *)(r1 + 4)
    "6115080000000000"  # r5 = *(u32 *)(r1 + 8)
    "5502070002000000"  # if r2 != 2 (char) goto +7
    "bf36000000000000"  # r6 = r3
    "54060000f9ff0000"  # w6 &= ~(r|w) & 0xffff
    "5506040000000000"  # if r6 != 0 goto +4
    "55040300c3000000"  # if r4 != 195 goto +3
    "5505020002000000"  # if r5 != 2 goto +2
    "b700000001000000"  # r0 = 1
    "9500000000000000"  # exit
)


def test_encoder_golden_bytes():
    assert encode_prefix((AllowDevice("c", 195, 2, "rw"),)) == GOLDEN_ONE_RULE


def test_prefix_is_recognised_and_stripped_on_a_second_run():
    original = insn(0xB7, 0, imm=0) + insn(0x95)  # r0 = 0; exit (deny all)
    rules = (AllowDevice("c", 195, 0, "rwm"), AllowDevice("b", 8, 1, "r"))
    decoded, rest = decode_rules(encode_prefix(rules) + original)
    assert decoded == rules
    assert rest == original
    assert decode_rules(original) == ((), original)


def test_cgroup_discovery_from_fixture_proc_trees():

    from devinject.linux.devcgroup import device_cgroup_of
    from tests.conftest import FIXTURES

    proc = FIXTURES / "proc"
    hybrid = device_cgroup_of(4242, proc=str(proc / "hybrid"))
    assert (hybrid.version, hybrid.path) == (1, "/sys/fs/cgroup/devices/runc/c1")
    unified = device_cgroup_of(4242, proc=str(proc / "unified"))
    assert (unified.version, unified.path) == (2, "/sys/fs/cgroup/di-test")


def test_grant_and_revert_on_a_real_v1_device_cgroup(v1_device_cgroup):
    """The rules a grant adds are in the kernel's devices.list, and revert takes exactly them back."""
    from devinject.hook.cgroup import CgroupGrant, DeviceCgroup
    from devinject.hook.plan import AllowDevice

    group = v1_device_cgroup
    (group / "devices.deny").write_text("a")
    (group / "devices.allow").write_text("c 1:3 rwm")  # the runtime's own rule: must survive the revert
    grant = CgroupGrant(DeviceCgroup(1, str(group)))
    grant.allow((AllowDevice("c", 195, 0, "rw"), AllowDevice("c", 1, 3, "rwm")))
    listed = (group / "devices.list").read_text().splitlines()
    assert "c 195:0 rw" in listed and "c 1:3 rwm" in listed
    grant.revert()
    assert (group / "devices.list").read_text().splitlines() == ["c 1:3 rwm"]
