"""Persistent on-disk cache of build artifacts (CUBINs and their metadata).

Layout::

    <cache_root()>/<arch target>/<kind>/<name>-<hash16>.bin   entry
    <cache_root()>/<arch target>/<kind>/<name>-<hash16>.lock  per-entry lock file (filelock)

``hash16`` is a prefix of the sha256 of every compile-time input (the ``key``
dict), so the file name is readable and any change of source, options, compiler
version or arch selects a different entry.

Each entry is ``MAGIC | u32 header length | header JSON | payload``; the header
holds the payload's sha256 and length and the key's hash, so a truncated or
corrupted entry (or a stale one from a hash-prefix collision) is detected and
rebuilt. Writes go to a temporary file in the entry's directory and are
published with ``os.replace`` (atomic on POSIX), under an exclusive
:class:`filelock.FileLock` on the entry's lock file, so concurrent processes
building the same entry build it once and never observe a partial file.
Nothing is written outside the cache root, in particular never into the
working directory.

Shared caches (a team or CI directory, or ``sudo kvarn-cutlass build`` into a
user's cache): entries, lock files and directories are created with the
process's umask (``umask 002`` in a group directory makes them group-writable),
not private to their creator. An entry that cannot be read (permissions) or is
not a regular file is treated like a corrupt one: it is rebuilt and replaced.
When the directory cannot be written, the error names the path and
``KVARN_CUTLASS_CACHE``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import stat
import struct
from pathlib import Path
from typing import Any, Callable, Mapping

import filelock
import platformdirs

from .arch import arch_target

__all__ = ["CACHE_ENV", "cache_root", "entry_path", "cached_artifact", "read_cache_file", "write_cache_file"]

CACHE_ENV = "KVARN_CUTLASS_CACHE"

_MAGIC = b"KVARNCC1"
_HEADER_LEN = struct.Struct("<I")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]+")
_KIND_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_MAX_NAME = 80

_log = logging.getLogger(__name__)


def cache_root() -> Path:
    """Root directory of the on-disk cache (not created here).

    ``$KVARN_CUTLASS_CACHE`` if set and non-empty, else the user cache directory of
    ``platformdirs`` (``$XDG_CACHE_HOME/kvarn-cutlass`` or ``~/.cache/kvarn-cutlass`` on Linux).
    The result is absolute, so a relative setting is resolved once against the working
    directory rather than followed as it changes.
    """
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser().absolute()
    return platformdirs.user_cache_path("kvarn-cutlass", appauthor=False).absolute()


def _canonical_key(key: Mapping[str, Any]) -> str:
    if not isinstance(key, Mapping):
        raise TypeError(f"key must be a dict of compile-time inputs, got {type(key).__name__}")
    if "arch" not in key:
        raise ValueError("key must contain 'arch' (entries are split by architecture)")
    try:
        return json.dumps(key, sort_keys=True, separators=(",", ":"))
    except TypeError as e:
        raise TypeError(f"key must be JSON-serializable (str, int, float, bool, None, lists, dicts): {e}") from None


def entry_path(kind: str, name: str, key: Mapping[str, Any]) -> Path:
    """Path of the cache entry for ``(kind, name, key)``; see the module docstring for the layout."""
    if not isinstance(kind, str) or not _KIND_RE.match(kind):
        raise ValueError(f"kind={kind!r} must be a plain directory name (letters, digits, '_', '.', '-')")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r} must be a non-empty str")
    key_hash = _key_digest(kind, name, key)
    readable = _NAME_UNSAFE.sub("_", name).strip("._")[:_MAX_NAME] or "entry"
    return cache_root() / arch_target(key["arch"]) / kind / f"{readable}-{key_hash[:16]}.bin"


def _key_digest(kind: str, name: str, key: Mapping[str, Any]) -> str:
    return hashlib.sha256(f"{kind}\0{name}\0{_canonical_key(key)}".encode()).hexdigest()


def _encode(payload: bytes, key_digest: str, key: Mapping[str, Any]) -> bytes:
    header = json.dumps(
        {
            "sha256": hashlib.sha256(payload).hexdigest(),
            "length": len(payload),
            "key_sha256": key_digest,
            "key": key,  # kept for humans inspecting the cache
        },
        sort_keys=True,
    ).encode()
    return _MAGIC + _HEADER_LEN.pack(len(header)) + header + payload


def _decode(blob: bytes, key_digest: str) -> tuple[bytes | None, str]:
    """(payload, "") for a valid entry, else (None, reason)."""
    fixed = len(_MAGIC) + _HEADER_LEN.size
    if len(blob) < fixed or not blob.startswith(_MAGIC):
        return None, "bad magic or truncated header"
    (hlen,) = _HEADER_LEN.unpack_from(blob, len(_MAGIC))
    if len(blob) < fixed + hlen:
        return None, "truncated header"
    try:
        header = json.loads(blob[fixed : fixed + hlen])
        length, digest, kdigest = int(header["length"]), str(header["sha256"]), str(header["key_sha256"])
    except (ValueError, KeyError, TypeError):
        return None, "unreadable header"
    payload = blob[fixed + hlen :]
    if kdigest != key_digest:
        return None, "entry belongs to another key"
    if len(payload) != length:
        return None, f"payload is {len(payload)} bytes, header says {length}"
    if hashlib.sha256(payload).hexdigest() != digest:
        return None, "payload checksum mismatch"
    return payload, ""


def read_cache_file(path: Path) -> tuple[bytes | None, str]:
    """``(contents, "")`` of a cache file, ``(None, "")`` when there is none, ``(None, reason)`` when
    something that cannot serve as one is there (unreadable, a directory, a FIFO, a device)."""
    try:
        # O_NONBLOCK: opening a FIFO planted at the path must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None, ""
    except OSError as e:  # permissions, a socket (ENXIO), a symlink loop
        return None, f"unreadable ({e.strerror or e})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "not a regular file"
        with open(fd, "rb", closefd=False) as f:
            return f.read(), ""
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    finally:
        os.close(fd)


def _read(path: Path, key_digest: str) -> tuple[bytes | None, str]:
    blob, reason = read_cache_file(path)
    if blob is None:
        return None, reason
    return _decode(blob, key_digest)


def _unwritable(path: Path, e: OSError) -> OSError:
    message = (f"cannot write the kernel cache at {path}: {e.strerror or e}; make it writable or set {CACHE_ENV} "
               "to a writable directory")
    return OSError(e.errno, message) if e.errno is not None else OSError(message)


def write_cache_file(path: Path, data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically: a temporary file in the same directory, then ``os.replace``.

    The file gets mode ``0o666`` less the umask, as any file the process creates (``tempfile.mkstemp``
    would make it 0600, unreadable to the other users of a shared cache). Whatever was at ``path``
    (a corrupt, unreadable or foreign entry) is replaced. Raises OSError naming ``path`` and
    ``KVARN_CUTLASS_CACHE`` when the directory cannot be written or ``path`` is a directory.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        raise _unwritable(path.parent, e) from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _unwritable(path, e) from e
        raise


def cached_artifact(kind: str, name: str, key: dict, build: Callable[[], bytes]) -> bytes:
    """Return the cached bytes for ``(kind, name, key)``, calling ``build()`` once if absent or invalid.

    Args:
        kind: artifact family, a directory name (e.g. ``"kernels"``, ``"gemm"``).
        name: readable name used in the file name (unsafe characters are replaced).
        key: every compile-time input as a JSON-serializable dict: source hash, options,
            compiler version and ``"arch"`` (required; entries are split by it).
        build: produces the artifact bytes; called under the entry's file lock, so at
            most one process builds a given entry at a time.

    Returns:
        The artifact bytes, identical to what ``build()`` returned when the entry was made.

    Raises:
        TypeError / ValueError: malformed ``kind``, ``name`` or ``key``, or ``build`` returned non-bytes.
        OSError: the cache directory cannot be created or written (message names it and the override).
    """
    path = entry_path(kind, name, key)
    digest = _key_digest(kind, name, key)
    payload, _ = _read(path, digest)
    if payload is not None:
        return payload
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(path.with_suffix(".lock"))
        lock.acquire()
    except OSError as e:
        raise _unwritable(path.parent, e) from e
    try:
        # Another process may have finished the entry while this one waited for the lock.
        payload, reason = _read(path, digest)
        if payload is not None:
            return payload
        if reason:
            _log.warning("kvarn-cutlass cache entry %s is invalid (%s); rebuilding", path, reason)
        built = build()
        if not isinstance(built, (bytes, bytearray, memoryview)):
            raise TypeError(f"build() for {kind}/{name} must return bytes, got {type(built).__name__}")
        payload = bytes(built)
        write_cache_file(path, _encode(payload, digest, key))
        return payload
    finally:
        lock.release()
