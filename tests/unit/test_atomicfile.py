"""core.atomicfile: a replaced file is the old one or the new one, never missing or half-written."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from devinject.core import atomicfile, libc


def _dir_fd(path):
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def test_an_existing_file_is_swapped_in_by_exchange_not_renamed_over(tmp_path, monkeypatch):
    target = tmp_path / "ld.so.cache"
    target.write_bytes(b"old")
    old_inode = target.stat().st_ino

    def no_rename_over(*args, **kwargs):
        raise AssertionError("a rename over an existing file makes ext4 write the new file back first")

    monkeypatch.setattr(atomicfile.os, "replace", no_rename_over)
    fd = _dir_fd(tmp_path)
    try:
        atomicfile.replace_at(fd, "ld.so.cache", b"new", 0o600)
    finally:
        os.close(fd)
    assert target.read_bytes() == b"new"
    assert target.stat().st_ino != old_inode
    assert target.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["ld.so.cache"]  # the old file is gone, no temp left


def test_a_new_file_and_a_link_in_the_way(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not to be written through")
    (tmp_path / "link").symlink_to(elsewhere)
    atomicfile.replace(str(tmp_path / "fresh"), b"one")
    atomicfile.replace(str(tmp_path / "link"), b"two")
    assert (tmp_path / "fresh").read_bytes() == b"one"
    assert not (tmp_path / "link").is_symlink() and (tmp_path / "link").read_bytes() == b"two"
    assert elsewhere.read_bytes() == b"not to be written through"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "fresh", "link"]


def test_a_directory_in_the_way_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "inside").write_text("kept")
    with pytest.raises(IsADirectoryError):
        atomicfile.replace(str(tmp_path / "cache"), b"data")
    assert (tmp_path / "cache" / "inside").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


@pytest.mark.parametrize("missing", [errno.EINVAL, errno.ENOSYS])
def test_without_the_exchange_it_is_a_plain_rename(tmp_path, monkeypatch, missing):
    def unavailable(*args):
        raise OSError(missing, os.strerror(missing))

    monkeypatch.setattr(libc, "rename_exchange", unavailable)
    (tmp_path / "file").write_bytes(b"old")
    atomicfile.replace(str(tmp_path / "file"), b"new")
    assert (tmp_path / "file").read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_reader_never_finds_the_file_missing_or_partial(tmp_path):
    path = tmp_path / "ledger.json"
    versions = [bytes([65 + i % 26]) * 4096 for i in range(26)]
    path.write_bytes(versions[0])
    problems: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                problems.append("missing")
                continue
            if data not in versions:
                problems.append(f"partial ({len(data)} bytes)")

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(400):
            atomicfile.replace(str(path), versions[i % 26])
    finally:
        done.set()
        reader.join()
    assert problems == []
