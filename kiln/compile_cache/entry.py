"""The compile cache: one directory per configuration, keyed by a hash of everything that
changes compiled artifacts. Inductor's and Triton's caches live inside it, so a configuration
change can never load another configuration's artifacts (a stale Inductor artifact specialized
for another batch size fails as "expected size 8==4").

An entry is valid when its manifest (written atomically last) lists files whose checksums still
match; anything else is warned about and rebuilt. Processes that boot the same configuration at
once take turns through the entry's lock (`lock.py`): one compiles, the others wait and
reuse what it sealed, and no process deletes an entry another is compiling into or reading."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.compile_cache.key import cache_key, kiln_source_hash, plan_key_fields, triton_version
from kiln.compile_cache.lock import LOCKS_DIR, EntryLock
from kiln.errors import ConfigError
from kiln.paths import kiln_cache_dir, writable_dir, write_atomically

logger = logging.getLogger(__name__)
MANIFEST = "manifest.json"
# the caches a compiled engine keeps inside its entry, and the entry's folder for each
CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def check_cache_env(root: Path, strict: bool) -> None:
    """A cache directory the user chose for Inductor or Triton is not used while a compiled
    engine boots: said loudly (an error in strict mode), not ignored in silence. A value
    Inductor wrote itself (its default, once anything compiled) or kiln's own is no choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    own = (Path(default_cache_dir()).resolve(), root.resolve())
    for var in CACHE_ENV:
        value = os.environ.get(var)
        if value is None or any(Path(value).resolve().is_relative_to(d) for d in own):
            continue
        message = (
            f"{var}={value} is not used while kiln compiles: each compiled configuration "
            f"keeps Inductor's and Triton's caches inside its own compile cache entry (under "
            f"{root}), so no configuration can load another's artifacts. Remedy: unset {var}, "
            "and set KILN_CACHE_DIR to choose where kiln's compile cache lives"
        )
        if strict:
            raise ConfigError(message)
        logger.warning(message)


def open_for_plan(
    plan: dict[str, Any],
    model_config: dict[str, Any],
    dtype: str,
    device: torch.device,
    root: Path | None = None,
) -> CompileCacheEntry:
    """The entry of a compiled engine, found or created (and locked: see `open`)."""
    root = writable_dir(root or compile_root())
    return CompileCacheEntry.open(plan_key_fields(plan, model_config, dtype, device), root)


def entry_for_plan(
    plan: dict[str, Any], model_config: dict[str, Any], dtype: str, device: torch.device
) -> Path:
    """Where that entry is, touching nothing: for showing it before a boot."""
    return compile_root() / cache_key(plan_key_fields(plan, model_config, dtype, device))


def is_sealed(path: Path) -> bool:
    """Whether a boot would reuse the entry at `path` (sealed and intact)."""
    return _verify(path) is None


def compile_root() -> Path:
    return Path(kiln_cache_dir()) / "compile"


@dataclass
class CompileCacheEntry:
    path: Path
    fields: dict[str, Any]
    reused: bool
    lock: EntryLock | None = field(default=None, repr=False)  # held from open to seal
    waited_s: float = 0.0  # for another process compiling this configuration
    saved_env: dict[str, str | None] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, fields: dict[str, Any], root: Path | None = None) -> CompileCacheEntry:
        """Find or create the entry for `fields`; a corrupted entry is rebuilt. Waits while
        another process compiles into it, then reuses what that process sealed."""
        path = (root or compile_root()) / cache_key(fields)
        lock = EntryLock(path)
        waited = lock.shared(lambda owner: _log_wait(path, owner))
        if _verify(path) is None:
            return cls(path, fields, True, lock, waited)
        waited += lock.exclusive(lambda owner: _log_wait(path, owner))
        problem = _verify(path)  # another process may have compiled it while this one waited
        if problem is None:
            lock.shared()
            return cls(path, fields, True, lock, waited)
        if path.exists():
            logger.warning("compile cache entry %s is corrupted (%s): rebuilding it", path, problem)
            _remove_for_rebuild(path, problem, lock)
        path.mkdir(parents=True, exist_ok=True)
        lock.record_owner()
        return cls(path, fields, False, lock, waited)

    def to_dict(self) -> dict[str, Any]:
        """What `/v1/engine` shows: where, whether reused, how long boot waited for it."""
        return {"path": str(self.path), "reused": self.reused, "waited_s": self.waited_s}

    def activate(self) -> None:
        """Point Inductor and Triton at this entry while the engine boots (the environment is
        process-wide: one engine boots at a time); `deactivate` puts back what was there."""
        self.saved_env = {var: os.environ.get(var) for var in CACHE_ENV}
        for var, sub in CACHE_ENV.items():
            os.environ[var] = str(self.path / sub)

    def deactivate(self) -> None:
        """After boot: a later compilation (a recompilation, the user's own torch.compile)
        goes where it would have gone without kiln, not into this sealed entry."""
        for var, value in self.saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        self.saved_env = {}

    def seal(self) -> None:
        """Record the artifacts with checksums; written last and atomically. A reused entry
        stays as its compilation sealed it (its creation time too): boots that read it hold
        the lock shared, so none may rewrite it."""
        if self.reused:
            self.release()
            return
        files = {
            str(p.relative_to(self.path)): _sha(p)
            for p in sorted(self.path.rglob("*"))
            if p.is_file() and p.name != MANIFEST
        }
        manifest = {"fields": self.fields, "created": time.time(), "files": files}
        text = json.dumps(manifest, indent=1, default=str)
        write_atomically(self.path / MANIFEST, text.encode())
        self.release()

    def release(self) -> None:
        """Let other processes rebuild or clear the entry: after sealing it, or when a boot
        fails before it could (an unsealed entry is then rebuilt by whoever opens it next)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _log_wait(path: Path, owner: str) -> None:
    logger.warning(
        "compile cache entry %s is locked by another kiln process booting this configuration "
        "(the last to compile it: %s): waiting for it, then reusing what it compiled (give "
        "this process its own KILN_CACHE_DIR to compile separately)",
        path,
        owner,
    )


def _remove_for_rebuild(path: Path, problem: str, lock: EntryLock) -> None:
    """A corrupted entry goes before it is compiled again; one this user cannot remove (another
    user's files in a shared cache) is an error naming the remedy, not a compilation over
    what is left of it."""
    why = _remove_tree(path)
    if why is None:
        return
    lock.release()
    raise ConfigError(
        f"compile cache entry {path} is corrupted ({problem}), and kiln cannot remove it to "
        f"rebuild it ({why}). Remedy: remove it as the user who owns its files (`kiln cache "
        f"clear {path.name}`), or set KILN_CACHE_DIR to a cache of your own"
    )


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verify(path: Path) -> str | None:
    """None when the entry is intact, else what is wrong with it."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest: an earlier compilation did not finish"
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable manifest: {exc}"
    for rel, digest in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        try:
            if _sha(f) != digest:
                return f"{rel} does not match its checksum"
        except OSError as exc:  # another user's file in a shared cache
            return f"{rel} is unreadable: {exc.strerror or exc}"
    return None


def _entry_dirs(root: Path) -> list[Path]:
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name != LOCKS_DIR)


def stale_reason(fields: dict[str, Any], source_hash: str) -> str | None:
    """Why this installation can never load an entry keyed by `fields` (None: it may)."""
    if fields.get("torch") != torch.__version__:
        return f"built by torch {fields.get('torch')}, this is {torch.__version__}"
    built_by = fields.get("triton")
    if built_by is not None and built_by != triton_version():
        return f"built by triton {built_by}, this is {triton_version()}"
    if fields.get("kiln_source") != source_hash:
        return "built by another version of kiln's source"
    return None


def list_entries(root: Path | None = None) -> list[dict[str, Any]]:
    """Every entry with its size, state and key fields. `compiling` names the process that is
    compiling into it now (such an entry has no manifest yet and is not corrupted); `stale`
    says why this installation can never load it (a kiln or torch upgrade keys new entries and
    leaves the old ones behind), corrupted entries included."""
    source_hash = kiln_source_hash()
    return [_describe_entry(path, source_hash) for path in _entry_dirs(root or compile_root())]


def _describe_entry(path: Path, source_hash: str) -> dict[str, Any]:
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    lock = EntryLock(path)
    compiling = lock.owner() if lock.held_exclusively_elsewhere() else None
    lock.release()
    problem = None if compiling else _verify(path)
    fields: dict[str, Any] = {}
    created = None
    stale = None if compiling else f"corrupted: {problem}"
    if problem is None and not compiling:
        manifest = json.loads((path / MANIFEST).read_text())
        fields, created = manifest.get("fields", {}), manifest.get("created")
        stale = stale_reason(fields, source_hash)
    return {
        "key": path.name,
        "path": str(path),
        "bytes": size,
        "valid": problem is None,
        "problem": problem,
        "compiling": compiling,
        "stale": stale,
        "created": created,
        "fields": fields,
    }


@dataclass
class ClearResult:
    removed: list[str] = field(default_factory=list)
    in_use: dict[str, str] = field(default_factory=dict)  # key -> the process using it
    failed: dict[str, str] = field(default_factory=dict)  # key -> why it could not be removed


def clear_entries(
    key: str | None = None, root: Path | None = None, only_stale: bool = False
) -> ClearResult:
    """Remove entries (all, the one named, or the stale ones), except those a running process
    is compiling into or booting from: deleting those under it is how a shared cache breaks."""
    root = root or compile_root()
    targets = [root / key] if key else _entry_dirs(root)
    if key and not targets[0].is_dir():
        raise ConfigError(
            f"the compile cache at {root} has no entry {key}: `kiln cache ls` lists them"
        )
    if only_stale:
        source_hash = kiln_source_hash()
        targets = [p for p in targets if _describe_entry(p, source_hash)["stale"]]
    result = ClearResult()
    for path in targets:
        lock = EntryLock(path)
        if not lock.try_exclusive():
            result.in_use[path.name] = lock.owner()
        elif (problem := _remove_tree(path)) is not None:
            result.failed[path.name] = problem
        else:
            result.removed.append(path.name)
        lock.release()
    return result


def _remove_tree(path: Path) -> str | None:
    """Why `path` could not be removed (another user's files in a shared cache, a read-only
    filesystem), or None once it is gone."""
    try:
        shutil.rmtree(path)
    except OSError as exc:
        return f"{exc.strerror or exc}: {exc.filename or path}"
    return None
