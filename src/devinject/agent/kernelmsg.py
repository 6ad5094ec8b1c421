"""Where the kernel's messages are read from: `/dev/kmsg` (the kernel's own ring buffer), the journal
(`journalctl`, its kernel transport), or a file a syslog daemon writes (`/var/log/kern.log`); each under the
host root. `--kernel-log` chooses: `auto` (the default: kmsg when it can be opened, else the journal when
there is one and `journalctl` to read it, else the file), `kmsg`, `journal`, or a file's path.

Every source follows (`read`: what was logged since the last read, whole lines, bounded), says cheaply whether
there is more (`pending`, asked every 0.2 s), and has a position (`position`/`resume`: `(identity, offset)`,
persisted by the agent so a restart reads on where it stopped and never reads an old message as a new
fault): a file's identity and byte offset; `kmsg:<boot id>` and the next sequence number; `journal:<cursor>`
and the entry's time (µs). `messages()` is the one-shot read of everything the source holds (this boot's),
each message with its place, so that a reader can leave out what was logged before a put-back
(`logged_after`).

Only the kernel's own messages count: kmsg records of the kernel facility (userspace may write to /dev/kmsg,
never as the kernel), the journal's `_TRANSPORT=kernel`, and what the syslog daemon wrote to the file.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from typing import Protocol

from devinject.core.paths import DEFAULT_KERNEL_LOG
from devinject.discovery.host import Host
from devinject.discovery.roots import auto_kernel_source, journal_under

log = logging.getLogger(__name__)

AUTO, KMSG, JOURNAL = "auto", "kmsg", "journal"
KMSG_PATH = "/dev/kmsg"
JOURNALCTL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
LOG_READ_MAX = 1 << 20  # bytes of kernel messages read per wake-up; the rest at the next one
LOG_LINE_MAX = 64 << 10  # an unterminated "line" this long is dropped (the kernel's own are < 1 KiB)
KMSG_RECORD_MAX = 1 << 16  # a read() smaller than a record fails (EINVAL); the kernel's are < 8 KiB
KERNEL_FACILITIES = (0,)  # LOG_KERN: a record userspace wrote to /dev/kmsg has another (LOG_USER at least)
ONE_SHOT_TIMEOUT = 30.0  # seconds for a one-shot `journalctl` read
ONE_SHOT_MAX = 64 << 20  # bytes of its answer
RESTART_PAUSE = 5.0  # seconds between restarts of a `journalctl --follow` that ended


@dataclass(frozen=True, slots=True)
class Message:
    """One line the kernel logged, with its place in the source (see the module's doc)."""

    identity: str | None
    offset: int
    text: bytes


class KernelMessages(Protocol):
    description: str

    def position(self) -> tuple[str | None, int | None]: ...
    def resume(self, identity: str | None, offset: int | None) -> None: ...
    def pending(self) -> bool: ...
    def read(self) -> bytes: ...
    def messages(self) -> list[Message]: ...
    def logged_after(self, message: Message, identity: str | None, offset: int | None) -> bool: ...
    def close(self) -> None: ...


# --- a file a syslog daemon writes ----------------------------------------------------------------------------
def _identity(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}"


class KernelLog:
    """Follows the kernel log as syslog writes it: appends, rotation (the file renamed and a new one made:
    the old one is read to its end first), truncation (copytruncate: read from the start). A read returns
    only whole lines, at most LOG_READ_MAX bytes of them (the rest at the next read); a line still being
    written is left for the read that finds its end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.description = f"the file {path}"
        self._fd: int | None = None
        self._identity: str | None = None  # of the open file
        self._offset: int | None = None  # read up to (the end of the last whole line); None: from its end
        self._seen: tuple[str | None, int] = (None, -1)  # (identity, size) of the path at the last read

    def available(self) -> bool:
        try:
            return stat.S_ISREG(os.stat(self.path).st_mode) and os.access(self.path, os.R_OK)
        except OSError:
            return False

    def position(self) -> tuple[str | None, int | None]:
        return self._identity, self._offset

    def resume(self, identity: str | None, offset: int | None) -> None:
        """Read on from `offset` of the file `identity` (a different file: the log was rotated meanwhile, read
        the new one from its start); `offset` 0 and no identity: the whole log; None: from its end. A position
        of another source (`kmsg:`, `journal:`) means nothing here: from its end."""
        self.close()
        if identity is not None and identity.startswith((f"{KMSG}:", f"{JOURNAL}:")):
            identity, offset = None, None
        self._identity, self._offset = identity, offset

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def pending(self) -> bool:
        """Whether the path changed since the last read (one stat: cheap enough to ask every 0.2 s)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (_identity(st), st.st_size) != self._seen

    def _open(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError:
            return False
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return False
        identity = _identity(st)
        if self._offset is None:  # first look: what is logged from now on
            self._offset = st.st_size
        elif self._identity not in (None, identity):  # another file than the one read before: rotated
            self._offset = 0
        self._fd, self._identity = fd, identity
        return True

    def _lines(self, budget: int, final: bool) -> tuple[bytes, bool]:
        """Whole lines from the open file, within budget, and whether that reached its end. `final`: the file
        is done with (rotated away), so a last line without its newline is taken too."""
        assert self._fd is not None and self._offset is not None
        size = os.fstat(self._fd).st_size
        if size < self._offset:  # truncated in place (copytruncate)
            self._offset = 0
        want = size - self._offset
        data = os.pread(self._fd, min(budget, want), self._offset)
        end = data.rfind(b"\n") + 1
        if (final and len(data) == want) or (not end and len(data) >= LOG_LINE_MAX):
            end = len(data)  # a last line that will never end, or a "line" too long to be one
        self._offset += end
        return data[:end], len(data) == want

    def read(self) -> bytes:
        """What was logged since the last read: whole lines, at most LOG_READ_MAX bytes."""
        try:
            st: os.stat_result | None = os.stat(self.path)
        except OSError:
            st = None  # renamed away and not made again yet: read on in the one we have
        if self._fd is None and not self._open():
            self._seen = (_identity(st), st.st_size) if st is not None else (None, -1)
            return b""
        out, done = b"", True
        if st is not None and _identity(st) != self._identity:  # rotated: finish the old file, then the new
            out, done = self._lines(LOG_READ_MAX, final=True)
            if done:
                self.close()
                self._offset = 0
                if not self._open():
                    return out
        if done:
            more, done = self._lines(LOG_READ_MAX - len(out), final=False)
            out += more
        # a read cut short by the bound leaves the path "changed", so the next wake-up reads on
        self._seen = (_identity(st), st.st_size) if st is not None and done else (None, -1)
        return out

    def messages(self) -> list[Message]:
        """Every line of the file, each at its byte offset (none when it cannot be read)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError:
            return []
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return []
            with os.fdopen(os.dup(fd), "rb") as handle:
                data = handle.read()
        finally:
            os.close(fd)
        identity, offset, out = _identity(st), 0, []
        for line in data.splitlines(keepends=True):
            out.append(Message(identity, offset, line.rstrip(b"\n")))
            offset += len(line)
        return out

    def logged_after(self, message: Message, identity: str | None, offset: int | None) -> bool:
        """Whether `message` was logged at or after the position (identity, offset) of this file: another
        file than the position's was made since (rotated), so all of it is newer."""
        if identity is None or offset is None or message.identity != identity:
            return True
        return message.offset >= offset


# --- /dev/kmsg -------------------------------------------------------------------------------------------------
def parse_kmsg_record(record: bytes) -> tuple[int, int, bytes] | None:
    """(facility, sequence number, message) of one /dev/kmsg record, `pri,seq,usec,flags[,...];message\\n`
    followed by ` KEY=value` lines (dropped); None for anything else. The message keeps the kernel's
    `\\xNN` escapes: a record is one line whatever it holds."""
    head, sep, rest = record.partition(b";")
    fields = head.split(b",")
    if not sep or len(fields) < 4:
        return None
    try:
        priority, sequence = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    if priority < 0 or sequence < 0:
        return None
    return priority >> 3, sequence, rest.partition(b"\n")[0]


class Kmsg:
    """Follows the kernel's ring buffer (/dev/kmsg): one record per read(), every reader with its own place
    in it. The place is the sequence number, which counts from the boot: a restarted agent reads on from the
    record after the last one it read in this boot (all of this boot's in another one); records overwritten
    before they were read are lost (EPIPE), and said so in the log."""

    def __init__(self, path: str, boot_id: str) -> None:
        self.path = path
        self.description = f"the kernel's ring buffer {path}"
        self.identity = f"{KMSG}:{boot_id}"
        self._fd: int | None = None
        self._next: int | None = None  # the sequence number to read next; None: from the end
        self._lost = 0

    def available(self) -> bool:
        fd = self._open_fd()
        if fd is None:
            return False
        os.close(fd)
        return True

    def _open_fd(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError:
            return None  # EPERM: dmesg_restrict without CAP_SYSLOG, or a device cgroup that denies it
        if not stat.S_ISCHR(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def position(self) -> tuple[str | None, int | None]:
        return self.identity, self._next

    def resume(self, identity: str | None, offset: int | None) -> None:
        """Read on from sequence number `offset` of this boot; the whole buffer after another boot's position
        (or `offset` 0 and no identity: read everything); from the end after another source's."""
        self.close()
        if identity == self.identity and offset is not None:
            self._next = offset
        elif (identity is None and offset == 0) or (identity or "").startswith(f"{KMSG}:"):
            self._next = 0
        else:
            self._next = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _records(self, fd: int, budget: int) -> list[tuple[int, int, bytes]]:
        out, size = [], 0
        while size < budget:
            try:
                data = os.read(fd, KMSG_RECORD_MAX)
            except BlockingIOError:
                break
            except BrokenPipeError:  # overwritten before we read them: the next read has the oldest kept
                self._lost += 1
                continue
            if not data:
                break
            record = parse_kmsg_record(data)
            if record is not None:
                out.append(record)
                size += len(record[2]) + 1
        return out

    def _ensure_open(self) -> bool:
        if self._fd is not None:
            return True
        fd = self._open_fd()
        if fd is None:
            return False
        if self._next is None:  # first look: what is logged from now on (the last sequence number kept)
            last = -1
            while records := self._records(fd, LOG_READ_MAX):
                last = records[-1][1]
            self._next = last + 1
        self._fd = fd
        return True

    def pending(self) -> bool:
        """Whether a record after our place is there (poll: no read)."""
        return self.wait(0.0)

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds for a record after our place (the follower's wake-up: the kernel
        wakes a poller at once, so an Xid is not left waiting for the next look)."""
        fd = self._fd
        if fd is None:
            if timeout:
                time.sleep(timeout)
            return os.path.exists(self.path)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(int(timeout * 1000)))
        except (OSError, ValueError):
            return False

    def read(self) -> bytes:
        """The kernel's records since the last read, one line each, at most LOG_READ_MAX bytes."""
        if not self._ensure_open():
            return b""
        assert self._fd is not None and self._next is not None
        lost, out = self._lost, []
        for facility, sequence, text in self._records(self._fd, LOG_READ_MAX):
            if sequence < self._next:
                continue  # read before a restart
            self._next = sequence + 1
            if facility in KERNEL_FACILITIES:
                out.append(text + b"\n")
        if self._lost != lost:
            log.warning("%s: kernel messages were overwritten before they were read", self.path)
        return b"".join(out)

    def messages(self) -> list[Message]:
        """Every kernel record the buffer still holds, at its sequence number."""
        fd = self._open_fd()
        if fd is None:
            return []
        try:
            out = []
            while records := self._records(fd, LOG_READ_MAX):
                out += [Message(self.identity, seq, text) for facility, seq, text in records
                        if facility in KERNEL_FACILITIES]
            return out
        finally:
            os.close(fd)

    def logged_after(self, message: Message, identity: str | None, offset: int | None) -> bool:
        if identity != self.identity or offset is None:
            return True  # another boot's position (or none): all of this boot is newer
        return message.offset >= offset


# --- the journal -------------------------------------------------------------------------------------------
def journalctl() -> str | None:
    return shutil.which("journalctl", path=JOURNALCTL_PATH)


def journal_directory(host: Host) -> str | None:
    """The journal under the host root: its persistent directory, else its volatile one (None: neither
    holds a journal)."""
    return journal_under(host.root)


def _journal_entry(line: bytes) -> tuple[str, int, bytes] | None:
    """(cursor, time in µs, message) of one `journalctl -o json` line; None for anything else."""
    try:
        entry = json.loads(line)
        cursor, stamp, message = entry["__CURSOR"], int(entry["__REALTIME_TIMESTAMP"]), entry.get("MESSAGE")
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(message, list):  # not UTF-8: the journal gives its bytes
        try:
            message = bytes(message).decode(errors="replace")
        except (ValueError, TypeError):
            return None
    if not isinstance(cursor, str) or not isinstance(message, str):
        return None
    return cursor, stamp, message.replace("\n", " ").encode()


class Journal:
    """Follows the journal's kernel messages of this boot through `journalctl --follow -o json` (a child
    process, restarted when it ends); the place is the last entry's cursor (`--after-cursor` on a restart).
    A one-shot read runs `journalctl` with a deadline and a bounded answer."""

    def __init__(self, host: Host, directory: str | None, executable: str | None) -> None:
        self.directory = directory  # None: the system journal (host root /)
        self.executable = executable
        self.boot_id = (host.read_attr("/proc/sys/kernel/random/boot_id") or "").replace("-", "")
        where = directory or "the system journal"
        self.description = f"the journal ({where}, through {executable or 'journalctl: not installed'})"
        self._cursor: str | None = None
        self._stamp: int | None = None
        self._started = False  # the place was set (resume, or the end found at the first read)
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._next_start = 0.0

    def available(self) -> bool:
        return self.executable is not None

    def _command(self, *extra: str) -> list[str]:
        assert self.executable is not None
        command = [self.executable, "--no-pager", "--quiet", "--output=json", "_TRANSPORT=kernel"]
        if self.boot_id:
            command.append(f"_BOOT_ID={self.boot_id}")
        if self.directory is not None:
            command.append(f"--directory={self.directory}")
        return [*command, *extra]

    def _run(self, *extra: str) -> list[tuple[str, int, bytes]]:
        """A one-shot `journalctl`: its entries, within ONE_SHOT_TIMEOUT and ONE_SHOT_MAX bytes."""
        if self.executable is None:
            return []
        try:
            proc = subprocess.Popen(self._command(*extra), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    stdin=subprocess.DEVNULL, env={"PATH": JOURNALCTL_PATH, "LC_ALL": "C"})
        except OSError as err:
            log.warning("%s: %s", self.executable, err.strerror)
            return []
        assert proc.stdout is not None
        chunks, size, deadline = [], 0, time.monotonic() + ONE_SHOT_TIMEOUT
        try:
            os.set_blocking(proc.stdout.fileno(), False)
            while size < ONE_SHOT_MAX:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("%s: no answer within %gs", self.executable, ONE_SHOT_TIMEOUT)
                    break
                ready, _, _ = select.select([proc.stdout], [], [], left)
                if not ready:
                    continue
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        entries = [_journal_entry(line) for line in b"".join(chunks).splitlines()]
        return [e for e in entries if e is not None]

    def position(self) -> tuple[str | None, int | None]:
        return (f"{JOURNAL}:{self._cursor}" if self._cursor else None), self._stamp

    def resume(self, identity: str | None, offset: int | None) -> None:
        """Read on after the entry `identity` names (`journal:<cursor>`); everything of this boot for `offset`
        0 and no identity; from the end for anything else."""
        self.close()
        if identity is not None and identity.startswith(f"{JOURNAL}:"):
            self._cursor, self._stamp, self._started = identity.partition(":")[2] or None, offset, True
        elif identity is None and offset == 0:
            self._cursor, self._stamp, self._started = None, 0, True
        else:
            self._cursor, self._stamp, self._started = None, None, False

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        self._buffer = b""

    def _follow(self) -> bool:
        if self._proc is not None and self._proc.poll() is None:
            return True
        if self._proc is not None:  # it ended: read on after the last entry we took, a little later
            log.warning("%s ended (exit %s); started again in %gs", self.executable, self._proc.returncode,
                        RESTART_PAUSE)
            self.close()
            self._next_start = time.monotonic() + RESTART_PAUSE
        if self.executable is None or time.monotonic() < self._next_start:
            return False
        if not self._started:  # first look: from the newest entry on
            newest = self._run("--lines=1")
            self._cursor, self._stamp = (newest[-1][0], newest[-1][1]) if newest else (None, None)
            self._started = True
        extra = [f"--after-cursor={self._cursor}"] if self._cursor else []
        try:
            self._proc = subprocess.Popen(self._command("--follow", "--lines=all", *extra), stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                          env={"PATH": JOURNALCTL_PATH, "LC_ALL": "C"})
        except OSError as err:
            log.warning("%s: %s", self.executable, err.strerror)
            self._next_start = time.monotonic() + RESTART_PAUSE
            return False
        assert self._proc.stdout is not None
        os.set_blocking(self._proc.stdout.fileno(), False)
        return True

    def pending(self) -> bool:
        proc = self._proc
        if proc is None or proc.stdout is None:
            return self.executable is not None and time.monotonic() >= self._next_start
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(ready) or proc.poll() is not None

    def read(self) -> bytes:
        if not self._follow():
            return b""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while len(self._buffer) < LOG_READ_MAX:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buffer += chunk
        lines, _, self._buffer = self._buffer.rpartition(b"\n")
        if len(self._buffer) > LOG_LINE_MAX:
            self._buffer = b""  # a "line" too long to be an entry
        out = []
        for line in lines.splitlines():
            entry = _journal_entry(line)
            if entry is not None:
                self._cursor, self._stamp = entry[0], entry[1]
                out.append(entry[2] + b"\n")
        return b"".join(out)

    def messages(self) -> list[Message]:
        return [Message(f"{JOURNAL}:{cursor}", stamp, text) for cursor, stamp, text in self._run()]

    def logged_after(self, message: Message, identity: str | None, offset: int | None) -> bool:
        if identity is None or not identity.startswith(f"{JOURNAL}:") or offset is None:
            return True
        return message.offset > offset


# --- the choice -----------------------------------------------------------------------------------------------
def open_source(host: Host, spec: str | None) -> KernelMessages:
    """The source `--kernel-log` names (under the host root): `kmsg`, `journal`, a file's path, or `auto` (kmsg
    when it can be opened, else the journal when it has one and journalctl is installed, else the file
    /var/log/kern.log)."""
    spec = spec or AUTO
    boot = host.read_attr("/proc/sys/kernel/random/boot_id") or "-"
    kmsg = Kmsg(host.real(KMSG_PATH), boot)
    if spec == KMSG:
        return kmsg
    directory = None if host.root == "/" else journal_directory(host) or host.real("/var/log/journal")
    journal = Journal(host, directory, journalctl())
    if spec == JOURNAL:
        return journal
    if spec != AUTO:
        return KernelLog(host.real(host.resolve(spec)))
    chosen = auto_kernel_source(host.root)
    if chosen == KMSG:
        return kmsg
    if chosen == JOURNAL:
        return journal
    return KernelLog(host.real(host.resolve(DEFAULT_KERNEL_LOG)))


def current_position(host: Host, spec: str | None) -> tuple[str | None, int | None]:
    """Where the source stands now (its last message's place, or a file's end): what a put-back records."""
    source = open_source(host, spec)
    if isinstance(source, KernelLog):
        try:
            st = os.stat(source.path)
        except OSError:
            return None, None
        return _identity(st), st.st_size
    found = source.messages()
    if not found:
        return (source.identity, 0) if isinstance(source, Kmsg) else (None, None)
    last = found[-1]
    return last.identity, last.offset + 1 if isinstance(source, Kmsg) else last.offset


def describe(source: KernelMessages) -> tuple[str, bool]:
    """What the agent says at start: which source it reads, and whether it can (False: it sees no Xids)."""
    available = getattr(source, "available", None)
    return source.description, bool(available()) if available is not None else True
