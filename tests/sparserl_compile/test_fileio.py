"""write_atomic: the file is replaced whole or left as it was."""

import os
import stat

import pytest

from sparserl_compile.fileio import write_atomic, write_json


def test_replaces_whole_and_leaves_no_temp_file(tmp_path):
    p = tmp_path / "a.json"
    p.write_text("old")
    write_atomic(p, "new ü")
    assert p.read_text(encoding="utf-8") == "new ü"
    write_atomic(p, b"\x00bytes", sync_dir=True)
    assert p.read_bytes() == b"\x00bytes"
    assert [q.name for q in tmp_path.iterdir()] == ["a.json"]


def test_private_files_are_owner_only_and_others_readable(tmp_path):
    write_atomic(tmp_path / "secret.cubin", b"x", private=True)
    write_atomic(tmp_path / "result.json", "{}")
    assert stat.S_IMODE(os.stat(tmp_path / "secret.cubin").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "result.json").st_mode) == 0o644


def test_a_failed_write_keeps_the_old_file_and_removes_the_temp_file(tmp_path, monkeypatch):
    p = tmp_path / "a.json"
    p.write_text("old")

    def broken(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="No space"):
        write_atomic(p, "new")
    assert p.read_text() == "old"
    assert [q.name for q in tmp_path.iterdir()] == ["a.json"]


def test_a_missing_folder_is_an_error_not_a_silent_mkdir(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "nope" / "a.json", "x")


def test_a_result_file_is_compact_json_with_the_same_values(tmp_path):
    import json

    p = tmp_path / "r.json"
    write_json(p, {"a": [1, 2.5], "b": {"c": "d"}, "e": {1}}, default=sorted)
    assert p.read_text() == '{"a":[1,2.5],"b":{"c":"d"},"e":[1]}\n'
    assert json.loads(p.read_text()) == {"a": [1, 2.5], "b": {"c": "d"}, "e": [1]}
