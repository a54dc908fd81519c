"""`kiln cache ls | clear [KEY] [--stale]`."""

from __future__ import annotations

import argparse
import datetime

from kiln.compile_cache.entry import clear_entries, compile_root, list_entries


def _describe(fields: dict) -> str:
    """The key fields of a sealed entry; an unsealed one has none to show."""
    if not fields:
        return ""
    comp = fields.get("compilation", {})
    arch = fields.get("model_config", {}).get("architecture", "?")
    triton = f" triton {fields['triton']}" if fields.get("triton") else ""
    env = "".join(f" {k}={v}" for k, v in fields.get("env", {}).items())
    backend = comp.get("backend")
    compiler = f" backend {backend}" if backend not in (None, "inductor") else ""
    compiler += "".join(f" {k}={v}" for k, v in (comp.get("inductor_compile_config") or {}).items())
    return (
        f"{arch} {fields.get('dtype', '?')} {fields.get('device', '?')} mode "
        f"{comp.get('mode', '?')} {comp.get('cudagraph_mode', '?')}{compiler} torch "
        f"{fields.get('torch')}{triton}{env}"
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "clear":
        result = clear_entries(args.key, only_stale=args.stale)
        n = len(result.removed)
        what = "stale compile cache entr" if args.stale else "compile cache entr"
        print(f"removed {n} {what}{'y' if n == 1 else 'ies'} from {compile_root()}")
        for key, owner in result.in_use.items():
            print(
                f"kept {key}: a running kiln process is compiling or loading it (last compiled "
                f"by {owner}); run `kiln cache clear` again once it has booted"
            )
        for key, problem in result.failed.items():
            print(
                f"could not remove {key} ({problem}): remove it as the user who owns its "
                "files, or point KILN_CACHE_DIR at a cache of your own"
            )
        return 1 if result.in_use or result.failed else 0
    rows = list_entries()
    if not rows:
        print(f"the compile cache at {compile_root()} is empty")
        return 0
    for r in rows:
        when = (
            datetime.datetime.fromtimestamp(r["created"]).isoformat(timespec="seconds")
            if r["created"]
            else "-"
        )
        state = "ok" if r["valid"] else f"CORRUPTED ({r['problem']})"
        if r["compiling"]:
            state = f"COMPILING (by {r['compiling']})"
        elif r["valid"] and r["stale"]:
            state = f"STALE ({r['stale']})"
        line = (
            f"{r['key']}  {r['bytes'] / 2**20:8.1f} MiB  {when}  {state}  {_describe(r['fields'])}"
        )
        print(line.rstrip())
    stale = [r for r in rows if r["stale"]]
    if stale:
        mib = sum(r["bytes"] for r in stale) / 2**20
        print(
            f"{len(stale)} of {len(rows)} entries ({mib:.1f} MiB) can never be loaded by this "
            "installation: `kiln cache clear --stale` removes them"
        )
    return 0
