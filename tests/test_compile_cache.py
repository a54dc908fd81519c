"""The compile cache: keyed by everything that changes artifacts, corrupted entries rebuilt,
`kiln cache ls|clear` showing and clearing it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from kiln.attention.backend import GraphSupport
from kiln.compile_cache.entry import (
    CACHE_ENV,
    MANIFEST,
    CompileCacheEntry,
    check_cache_env,
    clear_entries,
    list_entries,
    open_for_plan,
)
from kiln.compile_cache.key import cache_key, cache_key_fields, kiln_source_hash, triton_version
from kiln.compile_cache.lock import lock_path
from kiln.config.compilation import CompilationConfig
from kiln.config.graph_plan import AttentionCaps, DeviceCaps, resolve_graph_plan
from kiln.paths import process_umask, temp_dir_in, write_atomically

BASE = dict(
    model_config={"architecture": "LlamaForCausalLM", "hidden_size": 64},
    compilation={
        "mode": 3,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "decode_capture_sizes": [1, 2, 4],
        "mixed_capture_sizes": [1, 2, 4],
        "splitting_ops": ["kiln::torch_paged_attention"],
    },
    dtype="float32",
    device="cuda:NVIDIA H200:sm90",
    source_hash="abc",
)


def _key(**changes) -> str:
    fields = {**BASE, **changes}
    return cache_key(cache_key_fields(**fields))


@pytest.mark.parametrize(
    "changes",
    [
        {"compilation": {**BASE["compilation"], "decode_capture_sizes": [1, 2, 4, 8]}},
        {"compilation": {**BASE["compilation"], "mixed_capture_sizes": [1, 2]}},
        {"compilation": {**BASE["compilation"], "cudagraph_mode": "PIECEWISE"}},
        {"compilation": {**BASE["compilation"], "mode": 0}},
        {"compilation": {**BASE["compilation"], "splitting_ops": []}},
        {"dtype": "bfloat16"},
        {"device": "cuda:NVIDIA H100:sm90"},
        {"model_config": {"architecture": "LlamaForCausalLM", "hidden_size": 128}},
        {"source_hash": "abd"},
    ],
)
def test_any_change_gives_another_directory(changes):
    assert _key(**changes) != _key()


def test_same_config_same_directory():
    assert _key() == _key()
    assert cache_key_fields(**BASE)["torch"]  # the torch version is part of the key


def test_the_compilers_environment_keys_the_entry(monkeypatch):
    """TORCHINDUCTOR_MAX_AUTOTUNE=1 compiles other kernels: another entry, not one that says
    "reused" while Inductor compiles inside it. Where the caches live changes nothing."""
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE", raising=False)
    before = _key()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/what/inductor/sets/once/it/compiles")
    assert _key() == before
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    assert _key() != before
    assert cache_key_fields(**BASE)["env"]["TORCHINDUCTOR_MAX_AUTOTUNE"] == "1"


def test_a_cpu_entry_is_keyed_by_the_cpus_flags(monkeypatch):
    """Inductor vectorises for the CPU's flags, and `--packed-activations auto` resolves by them
    (two int8 planes with AVX512-VNNI, float32 without): one shared cache, an entry per CPU."""
    import kiln.compile_cache.key as key

    cpu = torch.device("cpu")
    monkeypatch.setattr(key, "cpu_flags", lambda: "flags\t\t: fpu avx2 fma")
    avx2 = key.device_signature(cpu)
    assert avx2 == key.device_signature(cpu) and avx2.startswith("cpu:")
    monkeypatch.setattr(key, "cpu_flags", lambda: "flags\t\t: fpu avx2 fma avx512f avx512_vnni")
    assert key.device_signature(cpu) != avx2


def test_triton_keys_cuda_entries_only():
    """Triton compiles the GPU pieces; the CPU's are C++, so a Triton upgrade leaves them be."""
    assert cache_key_fields(**BASE)["triton"] == triton_version()
    assert cache_key_fields(**{**BASE, "device": "cpu"})["triton"] is None


def _plan(**requested) -> dict:
    attention = AttentionCaps("triton", GraphSupport.ALWAYS, ("kiln::triton_paged_attention",))
    plan = resolve_graph_plan(
        CompilationConfig(**requested),
        DeviceCaps("cuda", True),
        attention,
        max_num_batched_tokens=256,
        max_num_seqs=64,
    )
    return plan.to_dict()


@pytest.mark.parametrize(
    "changes",
    [
        {"cudagraph_capture_sizes": (1, 2, 4, 8)},
        {"cudagraph_capture_sizes": None, "max_cudagraph_capture_size": 16},
        {"cudagraph_mode": "PIECEWISE"},
        {"cudagraph_mode": "FULL"},
        {"splitting_ops": ()},
        {"backend": "eager"},
        {"backend": "aot_eager"},
        {"inductor_compile_config": {"size_asserts": False}},
    ],
)
def test_the_engine_keys_its_entry_by_the_resolved_plan(tmp_path, changes):
    """What the engine passes in (a resolved plan), not only the key function, tells entries
    apart."""
    base = {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": (1, 2, 4)}
    path = _entry_path(_plan(**base), tmp_path)
    assert _entry_path(_plan(**base), tmp_path) == path
    assert _entry_path(_plan(**{**base, **changes}), tmp_path) != path


def _entry_path(plan: dict, root) -> str:
    entry = open_for_plan(plan, BASE["model_config"], "float32", torch.device("cpu"), root)
    entry.release()  # unsealed: the next open of the same entry rebuilds it, without waiting
    return entry.path


def test_a_request_that_resolves_to_the_same_plan_shares_the_entry(tmp_path):
    sizes = {"mode": 3, "cudagraph_capture_sizes": (1, 2, 4)}
    same = [
        {**sizes, "max_cudagraph_capture_size": 16},  # caps nothing: same artifacts
        {**sizes, "backend": "inductor"},  # the default, spelt out
        {**sizes, "debug_dump_path": str(tmp_path / "dump")},  # writes beside, not into, it
        # Inductor options are unused without Inductor
        {**sizes, "backend": "eager", "inductor_compile_config": {"size_asserts": False}},
    ]
    base = _entry_path(_plan(**sizes), tmp_path)
    assert [_entry_path(_plan(**s), tmp_path) == base for s in same[:3]] == [True] * 3
    eager = _entry_path(_plan(**{**sizes, "backend": "eager"}), tmp_path)
    assert _entry_path(_plan(**same[3]), tmp_path) == eager


class _VersionedPass(CustomGraphPass):
    """A graph pass as Inductor's cache wants one: its uuid names its version."""

    def __init__(self, version: str) -> None:
        self.version = version

    def __call__(self, graph) -> None:
        pass

    def uuid(self) -> str:
        return self.version


def test_a_graph_pass_keys_the_entry_by_its_uuid(tmp_path):
    """An object among the Inductor options keys the entry by its class and uuid(), not by its
    address (which printed into the key gave every process its own entry): two instances of
    one version share the entry, another version gets its own. The plan stays JSON for
    `/v1/engine`."""

    def plan_with(version: str) -> dict:
        options = {"post_grad_custom_post_pass": _VersionedPass(version)}
        return _plan(mode=3, inductor_compile_config=options)

    path = {version: _entry_path(plan_with(version), tmp_path) for version in ("v1", "v2")}
    again = plan_with("v1")  # another instance
    assert _entry_path(again, tmp_path) == path["v1"] != path["v2"]
    shown = f"{__name__}._VersionedPass(uuid='v1')"
    assert json.loads(json.dumps(again))["inductor_compile_config"] == {
        "post_grad_custom_post_pass": shown
    }


def test_corrupted_entry_is_rebuilt(tmp_path, caplog):
    fields = cache_key_fields(**BASE)
    entry = CompileCacheEntry.open(fields, tmp_path)
    assert not entry.reused
    artifact = entry.path / "inductor" / "piece.py"
    artifact.parent.mkdir()
    artifact.write_text("compiled code")
    entry.seal()
    sealed = (entry.path / MANIFEST).read_bytes()
    reopened = CompileCacheEntry.open(fields, tmp_path)
    assert reopened.reused
    (entry.path / "inductor" / "later.py").write_text("written by a boot that reused it")
    reopened.seal()  # what a boot that reused the entry does once warmed up: it lets go
    assert (entry.path / MANIFEST).read_bytes() == sealed  # as its compilation sealed it
    assert reopened.lock is None
    artifact.write_text("compiled code, truncated by a crash")
    with caplog.at_level(logging.WARNING):
        again = CompileCacheEntry.open(fields, tmp_path)
    assert not again.reused and not artifact.exists()
    assert "corrupted" in caplog.text and "checksum" in caplog.text
    # an entry whose compilation never finished (no manifest) is rebuilt too
    again.release()
    with caplog.at_level(logging.WARNING):
        assert not CompileCacheEntry.open(fields, tmp_path).reused
    assert "no manifest" in caplog.text


# Another kiln process opening an entry: prints whether it reused it, or, told to crash, dies
# mid-compilation (as a killed or OOM-ed boot does) after writing a partial artifact.
OPEN_ELSEWHERE = """
import json, logging, os, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
from kiln.compile_cache.entry import CompileCacheEntry
entry = CompileCacheEntry.open(json.loads(sys.argv[1]), Path(sys.argv[2]))
if sys.argv[3] == "crash":
    (entry.path / "partial.py").write_text("half a kernel")
    os._exit(3)
print(json.dumps({"reused": entry.reused, "waited": entry.waited_s > 0}))
"""


def _open_elsewhere(fields: dict, root, then: str = "report") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", OPEN_ELSEWHERE, json.dumps(fields, default=str), str(root), then],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _first_line_with(stream, text: str) -> str:
    """Blocks until the other process writes a line holding `text`; '' if it exits first."""
    for line in stream:
        if text in line:
            return line
    return ""


def test_a_second_process_waits_for_the_compilation_and_reuses_it(tmp_path):
    """Two replicas booting one configuration: the second neither deletes the first's
    unfinished entry (what treating "no manifest" as corruption did) nor compiles beside it."""
    fields = cache_key_fields(**BASE)
    builder = CompileCacheEntry.open(fields, tmp_path)
    artifact = builder.path / "inductor" / "piece.py"
    artifact.parent.mkdir()
    artifact.write_text("compiled code")
    other = _open_elsewhere(fields, tmp_path)
    waiting = _first_line_with(other.stderr, "waiting for it")
    assert f"pid {os.getpid()} " in waiting, other.communicate(timeout=60)
    assert artifact.read_text() == "compiled code"
    builder.seal()
    out, err = other.communicate(timeout=120)
    assert other.returncode == 0, err
    assert json.loads(out) == {"reused": True, "waited": True}
    assert artifact.read_text() == "compiled code" and "corrupted" not in err


def test_a_compilation_whose_process_died_is_rebuilt_without_waiting(tmp_path, caplog):
    fields = cache_key_fields(**BASE)
    crashed = _open_elsewhere(fields, tmp_path, then="crash")
    assert crashed.wait(timeout=120) == 3
    with caplog.at_level(logging.WARNING):
        entry = CompileCacheEntry.open(fields, tmp_path)  # the kernel dropped the dead one's lock
    assert not entry.reused and not (entry.path / "partial.py").exists()
    assert "did not finish" in caplog.text and "waiting" not in caplog.text
    assert entry.waited_s == 0.0
    entry.release()


def test_clear_keeps_what_a_running_process_compiles(tmp_path):
    compiling = CompileCacheEntry.open(cache_key_fields(**BASE), tmp_path)
    sealed = CompileCacheEntry.open(cache_key_fields(**{**BASE, "dtype": "bfloat16"}), tmp_path)
    sealed.seal()
    rows = {row["key"]: row for row in list_entries(tmp_path)}
    assert f"pid {os.getpid()} " in rows[compiling.path.name]["compiling"]
    assert rows[sealed.path.name]["valid"] and rows[sealed.path.name]["compiling"] is None
    result = clear_entries(root=tmp_path)
    assert result.removed == [sealed.path.name] and list(result.in_use) == [compiling.path.name]
    assert compiling.path.is_dir()
    compiling.seal()
    assert clear_entries(root=tmp_path).removed == [compiling.path.name]


def test_cache_files_take_the_umask_so_that_a_group_can_share_the_cache(tmp_path):
    """What kiln writes into a cache gets the mode a plain open or mkdir would: under umask
    002 (a cache shared by a group) the other members can read the manifest and lock the
    entry. mkstemp's 0600 and mkdtemp's 0700 shut them out: the manifest unreadable, the entry
    looked corrupt to them and they deleted it; the lock file refused them with a traceback."""
    fields = cache_key_fields(**BASE)
    before = os.umask(0o002)
    try:
        assert process_umask() == 0o002
        entry = CompileCacheEntry.open(fields, tmp_path)
        entry.seal()
        write_atomically(tmp_path / "trace.bin", b"a saved trace")
        converted = Path(temp_dir_in(tmp_path))  # where a GGUF tokenizer is converted
        os.umask(0o077)
        write_atomically(tmp_path / "private.bin", b"a private trace")
    finally:
        os.umask(before)
    modes = {
        p.name: p.stat().st_mode & 0o777
        for p in (entry.path / MANIFEST, lock_path(entry.path), tmp_path / "trace.bin", converted)
    }
    assert modes == {
        MANIFEST: 0o664,
        f"{entry.path.name}.lock": 0o664,
        "trace.bin": 0o664,
        converted.name: 0o775,
    }
    assert (tmp_path / "private.bin").stat().st_mode & 0o777 == 0o600


def test_a_lock_file_this_user_cannot_write_is_locked_read_only(tmp_path, monkeypatch):
    """Another member of the group made the lock file before umask 002 was set (0644): kiln
    opens it read-only, which flock needs no more than, and leaves its owner line alone."""
    from kiln.compile_cache import lock as cache_lock

    fields = cache_key_fields(**BASE)
    first = CompileCacheEntry.open(fields, tmp_path)
    first.seal()
    lock_file = lock_path(first.path)
    owner = lock_file.read_text()
    real_open = os.open

    def as_another_user(path, flags, *mode):
        if Path(path) == lock_file and flags & os.O_RDWR:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *mode)

    monkeypatch.setattr(cache_lock.os, "open", as_another_user)
    reused = CompileCacheEntry.open(fields, tmp_path)
    assert reused.reused and reused.lock is not None and not reused.lock.writable
    reused.release()
    rebuilt = CompileCacheEntry.open({**fields, "dtype": "bfloat16"}, tmp_path)  # its own file
    assert rebuilt.lock.writable
    lock = cache_lock.EntryLock(first.path)  # compiling into the other user's entry
    assert lock.exclusive() == 0.0
    lock.record_owner()
    assert lock_file.read_text() == owner
    lock.release()
    rebuilt.release()


def test_a_filesystem_without_locks_is_warned_about_and_still_cached(tmp_path, caplog, monkeypatch):
    import errno

    from kiln.compile_cache import lock as cache_lock

    def no_locks(file, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(cache_lock.fcntl, "flock", no_locks)
    fields = cache_key_fields(**BASE)
    with caplog.at_level(logging.WARNING):
        entry = CompileCacheEntry.open(fields, tmp_path)
    assert not entry.reused and "may race on this cache" in caplog.text
    entry.seal()
    again = CompileCacheEntry.open(fields, tmp_path)
    assert again.reused
    again.release()


def test_a_failed_boot_lets_go_of_its_entry(tiny_models, tmp_path, monkeypatch):
    """An engine whose boot fails after opening its entry (here: a KV budget too small, found
    before anything compiles) must not leave it locked for the next engine of this process,
    even while the failure's traceback keeps the half-built engine alive (as a notebook or a
    logged exception does)."""
    from kiln import LLM
    from kiln.errors import ConfigError

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    for var in CACHE_ENV:
        monkeypatch.delenv(var, raising=False)
    failures = []
    for _ in range(2):  # the second boot would wait for the first's lock, up to its timeout
        with pytest.raises(ConfigError, match="raise --kv-cache-memory") as failed:
            LLM(
                tiny_models["llama"],
                kv_cache_memory="1KiB",
                compilation_config={"mode": 3},
                boot_timeout=20,
            )
        failures.append(failed)
    (row,) = list_entries(tmp_path / "compile")
    assert row["compiling"] is None and "did not finish" in row["problem"]
    # pointed into it no longer (Inductor may have set its own default meanwhile: not kiln's)
    inside = {v: os.environ[v] for v in CACHE_ENV if str(tmp_path) in os.environ.get(v, "")}
    assert not inside, inside


def test_a_cache_dir_kiln_cannot_write_is_a_clear_error(tiny_models, tmp_path, monkeypatch):
    from kiln import LLM
    from kiln.errors import ConfigError

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("KILN_CACHE_DIR", str(not_a_dir))
    with pytest.raises(ConfigError, match=r"cannot write its cache directory .*set KILN_CACHE_DIR"):
        LLM(tiny_models["llama"], compilation_config={"mode": 3})


def test_a_dump_path_kiln_cannot_write_is_a_clear_error(tiny_models, tmp_path):
    from kiln import LLM
    from kiln.errors import ConfigError

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    config = {"mode": 3, "debug_dump_path": str(not_a_dir / "dump")}
    with pytest.raises(ConfigError, match=r"cannot write debug_dump_path .*set debug_dump_path"):
        LLM(tiny_models["llama"], compilation_config=config)


def test_activate_points_inductor_inside_the_entry_until_boot_ends(tmp_path, monkeypatch):
    """Boot compiles inside the entry; afterwards the environment is what it was, so a later
    compilation (the user's own torch.compile) does not write into the sealed entry."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "users"))
    entry = CompileCacheEntry.open(cache_key_fields(**BASE), tmp_path)
    entry.activate()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(entry.path))
    assert os.environ["TRITON_CACHE_DIR"].startswith(str(entry.path))
    entry.seal()
    entry.deactivate()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "users")


@pytest.mark.parametrize("var", ["TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"])
def test_a_cache_dir_the_user_chose_is_warned_about(var, tmp_path, monkeypatch, caplog):
    """Loud, not silent: kiln's entry replaces it while compiling; strict mode refuses."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from kiln.errors import ConfigError

    for other in CACHE_ENV:
        monkeypatch.delenv(other, raising=False)
    root = tmp_path / "compile"
    monkeypatch.setenv(var, str(tmp_path / "mine"))
    with caplog.at_level(logging.WARNING):
        check_cache_env(root, strict=False)
    (record,) = caplog.records
    assert f"{var}={tmp_path / 'mine'} is not used" in record.getMessage()
    assert "Remedy: unset" in record.getMessage() and "KILN_CACHE_DIR" in record.getMessage()
    with pytest.raises(ConfigError, match=f"{var}=.* is not used"):
        check_cache_env(root, strict=True)
    caplog.clear()
    for not_a_choice in (default_cache_dir(), str(root / "abc" / "inductor")):
        monkeypatch.setenv(var, not_a_choice)  # Inductor's own default, or a kiln entry's
        check_cache_env(root, strict=True)
    assert not caplog.records


def test_stale_entries_are_told_apart_and_cleared_alone(tmp_path):
    """A kiln or torch upgrade keys new entries; the old ones can never load again."""
    current = {**BASE, "source_hash": kiln_source_hash()}
    entries = {
        "current": CompileCacheEntry.open(cache_key_fields(**current), tmp_path),
        "old kiln": CompileCacheEntry.open(cache_key_fields(**BASE), tmp_path),
        "old torch": CompileCacheEntry.open(
            {**cache_key_fields(**current), "torch": "2.0.0"}, tmp_path
        ),
        "old triton": CompileCacheEntry.open(
            {**cache_key_fields(**current), "triton": "2.0.0"}, tmp_path
        ),
        "corrupted": CompileCacheEntry.open(
            cache_key_fields(**{**current, "dtype": "bfloat16"}), tmp_path
        ),
    }
    for entry in entries.values():
        entry.seal()
    (entries["corrupted"].path / MANIFEST).write_text("{truncated")
    names = {entry.path.name: name for name, entry in entries.items()}
    stale = {names[row["key"]]: row["stale"] for row in list_entries(tmp_path)}
    assert stale.pop("corrupted").startswith("corrupted: unreadable manifest")
    assert stale == {
        "current": None,
        "old kiln": "built by another version of kiln's source",
        "old torch": f"built by torch 2.0.0, this is {torch.__version__}",
        "old triton": f"built by triton 2.0.0, this is {triton_version()}",
    }
    removed = clear_entries(root=tmp_path, only_stale=True).removed
    assert sorted(names[k] for k in removed) == [
        "corrupted",
        "old kiln",
        "old torch",
        "old triton",
    ]
    assert [row["key"] for row in list_entries(tmp_path)] == [entries["current"].path.name]


def test_cli_ls_and_clear(tmp_path):
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path)}
    root = tmp_path / "compile"
    current = {**BASE, "source_hash": kiln_source_hash()}
    compiler = {"backend": "inductor", "inductor_compile_config": {"max_autotune": True}}
    compilation = {**BASE["compilation"], **compiler}
    entry = CompileCacheEntry.open(
        cache_key_fields(**{**current, "compilation": compilation}), root
    )
    entry.seal()
    stale = CompileCacheEntry.open(cache_key_fields(**BASE), root)
    stale.seal()
    compiling = CompileCacheEntry.open(cache_key_fields(**{**current, "dtype": "bfloat16"}), root)

    def kiln(*args):
        return subprocess.run(
            [sys.executable, "-m", "kiln", "cache", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = kiln("ls")
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert out.returncode == 0 and "  ok  " in lines[entry.path.name]
    assert "FULL_AND_PIECEWISE max_autotune=True torch" in lines[entry.path.name]
    assert f"COMPILING (by pid {os.getpid()} " in lines[compiling.path.name]
    assert lines[compiling.path.name].endswith(")")  # no key fields to show until it is sealed
    triton = f" triton {triton_version()}" if triton_version() else ""
    assert f"torch {torch.__version__}{triton}" in lines[entry.path.name]
    assert "STALE (built by another version of kiln's source)" in lines[stale.path.name]
    assert "1 of 3 entries" in out.stdout and "kiln cache clear --stale" in out.stdout
    out = kiln("clear", "--stale")
    assert out.returncode == 0 and "removed 1 stale" in out.stdout and not stale.path.exists()
    out = kiln("clear")
    assert out.returncode == 1 and "removed 1" in out.stdout
    assert f"kept {compiling.path.name}" in out.stdout and "again once it has booted" in out.stdout
    out = kiln("clear", "0123456789abcdef0123")
    assert out.returncode == 2 and "no entry 0123456789abcdef0123" in out.stderr
    assert "Traceback" not in out.stderr
    compiling.seal()
    out = kiln("clear")
    assert out.returncode == 0 and "removed 1" in out.stdout
    assert "empty" in kiln("ls").stdout


def test_cache_ls_names_the_piece_backend_when_it_is_not_inductor():
    from kiln.cli.cache import _describe

    def row(**compiler):
        return _describe(
            cache_key_fields(**{**BASE, "compilation": {**BASE["compilation"], **compiler}})
        )

    assert " backend eager torch " in row(backend="eager", inductor_compile_config={})
    assert "backend" not in row(backend="inductor") + row()  # the default; entries before the field


def test_an_entry_clear_cannot_remove_is_reported_not_a_traceback(tmp_path, monkeypatch, capsys):
    """In a shared cache another user's files may not be this user's to delete (a test run as
    root deletes anything, so rmtree is made to refuse, as the kernel would): `kiln cache
    clear` names the entry, why and the remedy, goes on with the rest, and exits 1."""
    import argparse

    from kiln.cli.cache import run as run_cache
    from kiln.compile_cache import entry as cache

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    root = tmp_path / "compile"
    theirs = CompileCacheEntry.open(cache_key_fields(**BASE), root)
    theirs.seal()
    mine = CompileCacheEntry.open(cache_key_fields(**{**BASE, "dtype": "bfloat16"}), root)
    mine.seal()
    rmtree = cache.shutil.rmtree

    def as_another_user(path, *args, **kwargs):
        if Path(path) == theirs.path:
            raise PermissionError(13, "Permission denied", str(theirs.path / MANIFEST))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(cache.shutil, "rmtree", as_another_user)
    code = run_cache(argparse.Namespace(action="clear", key=None, stale=False))
    out = capsys.readouterr().out
    assert code == 1 and "removed 1 compile cache entry" in out
    why = f"Permission denied: {theirs.path / MANIFEST}"
    assert f"could not remove {theirs.path.name} ({why})" in out
    assert "KILN_CACHE_DIR at a cache of your own" in out
    assert theirs.path.is_dir() and not mine.path.exists()


def test_an_entry_this_user_cannot_read_or_remove_is_an_error_naming_the_remedy(
    tmp_path, monkeypatch
):
    """Another user's entry in a shared cache, its files unreadable to this one (made so by
    refusing the reads: root reads anything): it is not intact, and since it cannot be removed
    to compile it again, boot stops with the remedy rather than a traceback or a compilation
    over the remains, and lets go of the entry's lock."""
    from kiln.compile_cache import entry as cache
    from kiln.errors import ConfigError

    fields = cache_key_fields(**BASE)
    theirs = CompileCacheEntry.open(fields, tmp_path)
    (theirs.path / "piece.py").write_text("compiled code")
    theirs.seal()
    sha = cache._sha

    def unreadable(path):
        if path.name == "piece.py":
            raise PermissionError(13, "Permission denied", str(path))
        return sha(path)

    monkeypatch.setattr(cache, "_sha", unreadable)
    monkeypatch.setattr(
        cache,
        "_remove_tree",
        lambda path: f"Permission denied: {path / 'piece.py'}",
    )
    with pytest.raises(ConfigError) as err:
        CompileCacheEntry.open(fields, tmp_path)
    message = str(err.value)
    assert "piece.py is unreadable: Permission denied" in message
    assert f"`kiln cache clear {theirs.path.name}`" in message and "KILN_CACHE_DIR" in message
    assert (theirs.path / "piece.py").read_text() == "compiled code"
    assert cache_lock_is_free(theirs.path)


def cache_lock_is_free(entry_path) -> bool:
    from kiln.compile_cache.lock import EntryLock

    lock = EntryLock(entry_path)
    try:
        return lock.try_exclusive()
    finally:
        lock.release()
