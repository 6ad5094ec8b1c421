"""core.atomicfile: a replaced file is the old one or the new one, never missing or half-written."""

from __future__ import annotations

import threading

import pytest

from devinject.core import atomicfile


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
