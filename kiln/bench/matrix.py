"""`kiln bench matrix`: one fresh server per configuration (its own process, its own empty
compile cache), the same probes and suite against each, one side-by-side table."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from typing import Any

from kiln.bench.client import BenchError, OpenAIClient, run_client
from kiln.bench.launcher import (
    external_command,
    free_port,
    kiln_serve_command,
    launch,
    server_env,
)
from kiln.bench.runner import BenchSettings, RunResult, run_passes
from kiln.profiles import Profile, load_profile

logger = logging.getLogger(__name__)


def matrix_profiles(
    configs: list[str], cudagraph_modes: list[str] | None, base: str | None
) -> list[Profile]:
    """Profiles named on the command line, or one per graph mode derived from `base`."""
    if cudagraph_modes:
        if configs:
            raise BenchError("give either --configs or --cudagraph-modes, not both")
        base_profile = load_profile(base or "smollm2-compiled")
        return [_with_graph_mode(base_profile, m) for m in cudagraph_modes]
    if len(configs) < 1:
        raise BenchError("name at least one configuration: --configs a.toml b.toml ...")
    profiles = [load_profile(c) for c in configs]
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        raise BenchError(f"configuration names must differ, got {names}")
    return profiles


def _with_graph_mode(profile: Profile, mode: str) -> Profile:
    """The profile with another cudagraph_mode (checked by the profile, as kiln serve would)."""
    if profile.engine != "kiln":
        raise BenchError(f"--cudagraph-modes needs a kiln profile, {profile.name!r} is external")
    compilation = dict(profile.serve.get("compilation_config", {})) | {"cudagraph_mode": mode}
    return profile.with_serve(f"{profile.name}:{mode}", compilation_config=compilation)


def run_matrix(
    profiles: list[Profile],
    model: str | None,
    settings: BenchSettings,
    out_dir: str,
    boot_timeout: float = 900,
    show_progress: bool = True,
) -> list[RunResult]:
    os.makedirs(out_dir, exist_ok=True)
    fallback_probes = next((p.probes for p in profiles if p.probes), ())
    results = []
    for profile in profiles:
        probes = profile.probes or fallback_probes  # one model, so one probe set
        try:
            results += _run_one(
                profile, model, settings, out_dir, boot_timeout, probes, show_progress
            )
        except BenchError as exc:  # the other configurations still get their rows
            logger.error("configuration %s failed: %s", profile.name, exc)
            results.append(RunResult(profile.name, "", model or "", "", settings, error=str(exc)))
    return results


def _run_one(
    profile: Profile,
    model: str | None,
    settings: BenchSettings,
    out_dir: str,
    boot_timeout: float,
    probes,
    show_progress: bool,
) -> list[RunResult]:
    port = free_port()
    is_kiln = profile.engine == "kiln"
    cache_dir = tempfile.mkdtemp(prefix="kiln-bench-cache-") if is_kiln else None
    build = kiln_serve_command if is_kiln else external_command
    command = build(profile, port, model)
    log_path = os.path.join(out_dir, f"server-{_safe(profile.name)}.log")
    try:
        server = launch(command, port, log_path, server_env(cache_dir), boot_timeout)
        try:
            own = dataclasses.replace(
                settings, text_checks=settings.text_checks and not profile.random_weights
            )
            try:
                results = run_client(_bench(server.base_url, profile, own, probes, show_progress))
            except BenchError as exc:  # a server that crashed mid-run says how
                raise BenchError(f"{exc}{server.death_note()}") from exc
        finally:
            exit_code = server.stop()
    finally:
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    for result in results:
        result.server |= {
            "boot_s": server.boot_s,
            "command": command,
            "log": log_path,
            "exit_code": exit_code,
            "fresh_compile_cache": cache_dir,
        }
    return results


async def _bench(
    base_url: str, profile: Profile, settings: BenchSettings, probes, show_progress: bool
) -> list[RunResult]:
    client = OpenAIClient(base_url, model="", timeout=settings.request_timeout)
    try:
        client.model = await served_model(client)
        return await bench_server(client, settings, profile.name, probes, show_progress)
    finally:
        await client.aclose()


async def bench_server(
    client: OpenAIClient, settings: BenchSettings, label: str, probes, show_progress: bool
) -> list[RunResult]:
    """The benchmark against one running server, each result with what the server said of
    itself (kiln's /v1/engine) and its speculative decoding over the benchmark's requests. A
    speculating server emits up to 1 + k tokens per step, and its streams are checked so."""
    info = await engine_info(client)
    spec_config = info.pop("speculative_config", None)
    if spec_config:
        k = spec_config["num_speculative_tokens"]
        settings = dataclasses.replace(settings, tokens_per_step=1 + k)
    results = await run_passes(client, settings, label, probes, show_progress)
    spec = spec_decode_delta(
        info.get("spec_decode"), (await engine_info(client)).get("spec_decode")
    )
    if spec and spec_config:
        spec["method"] = spec_config["method"]
    for result in results:
        result.server = dict(info) | ({"spec_decode": spec} if spec else {})
    return results


async def served_model(client: OpenAIClient) -> str:
    data = await client.get_json("/v1/models")
    models = (data or {}).get("data") or []
    if not models:
        raise BenchError(f"{client.base_url}/v1/models lists no model")
    return str(models[0]["id"])


async def engine_info(client: OpenAIClient) -> dict[str, Any]:
    """kiln's /v1/engine: the graph plan, boot phases and capture numbers (other servers: {})."""
    data = await client.get_json("/v1/engine")
    if not data:
        return {}
    keys = ("graph_plan", "boot", "capture", "attention_backend", "device", "dtype",
            "speculative_config")  # fmt: skip
    info = {k: data[k] for k in keys if k in data}
    spec = (data.get("stats") or {}).get("spec_decode")
    return info | ({"spec_decode": spec} if spec else {})


def spec_decode_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """The speculative-decoding counters of the benchmark's own requests: `after` less
    `before` (kiln's /v1/engine stats; None for a server without speculation)."""
    if not after:
        return None
    before = before or {}
    k = len(after["accepted_per_position"])
    drafts, tokens, accepted = (
        after[key] - before.get(key, 0)
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    )
    earlier = before.get("accepted_per_position") or [0] * k
    per_pos = [a - b for a, b in zip(after["accepted_per_position"], earlier)]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / tokens if tokens else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        "acceptance_per_position": [n / drafts if drafts else 0.0 for n in per_pos],
    }


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
