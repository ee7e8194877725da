"""Persistent on-disk cache of build artifacts (CUBINs and their metadata).

Layout::

    <cache_root()>/<arch target>/<kind>/<name>-<hash16>.bin   entry
    <cache_root()>/<arch target>/<kind>/<name>-<hash16>.lock  per-entry lock file

``hash16`` is a prefix of the sha256 of every compile-time input (the ``key``
dict), so the file name is readable and any change of source, options, compiler
version or arch selects a different entry.

Each entry is ``MAGIC | u32 header length | header JSON | payload``; the header
holds the payload's sha256 and length and the key's hash, so a truncated or
corrupted entry (or a stale one from a hash-prefix collision) is detected,
removed and rebuilt. Writes go to a temporary file in the entry's directory and
are published with ``os.replace`` (atomic on POSIX), under an exclusive
``fcntl.flock`` on the entry's lock file, so concurrent processes building the
same entry build it once and never observe a partial file. Nothing is written
outside the cache root, in particular never into the working directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from .arch import arch_target

__all__ = ["CACHE_ENV", "cache_root", "entry_path", "cached_artifact"]

CACHE_ENV = "KVARN_CUTLASS_CACHE"

_MAGIC = b"KVARNCC1"
_HEADER_LEN = struct.Struct("<I")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]+")
_KIND_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_MAX_NAME = 80

_log = logging.getLogger(__name__)


def cache_root() -> Path:
    """Root directory of the on-disk cache (not created here).

    ``$KVARN_CUTLASS_CACHE`` if set and non-empty, else ``$XDG_CACHE_HOME/kvarn-cutlass``,
    else ``~/.cache/kvarn-cutlass``. The result is absolute, so a relative setting is
    resolved once against the working directory rather than followed as it changes.
    """
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    # The XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "kvarn-cutlass"


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


def _read(path: Path, key_digest: str) -> tuple[bytes | None, str]:
    try:
        blob = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None, ""
    return _decode(blob, key_digest)


def _write_atomic(path: Path, blob: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
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
        lock_fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OSError(f"cannot write the cache directory {path.parent}: {e}; set {CACHE_ENV} to a writable directory") from e
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        # Another process may have finished the entry while this one waited for the lock.
        payload, reason = _read(path, digest)
        if payload is not None:
            return payload
        if reason:
            _log.warning("kvarn-cutlass cache entry %s is invalid (%s); rebuilding", path, reason)
            path.unlink(missing_ok=True)
        built = build()
        if not isinstance(built, (bytes, bytearray, memoryview)):
            raise TypeError(f"build() for {kind}/{name} must return bytes, got {type(built).__name__}")
        payload = bytes(built)
        _write_atomic(path, _encode(payload, digest, key))
        return payload
    finally:
        os.close(lock_fd)  # closing the descriptor releases the flock
