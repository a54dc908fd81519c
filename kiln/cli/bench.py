"""`kiln bench run | matrix`: the context benchmark, cold and validated. Every bench module is
imported here, before the first server boots: a matrix runs for an hour, and a module imported
at its end would be whatever the checkout holds by then."""

from __future__ import annotations

import argparse
import datetime
import os

from kiln.bench.client import OpenAIClient, run_client
from kiln.bench.matrix import bench_server, matrix_profiles, run_matrix, served_model
from kiln.bench.passes import markdown_passes
from kiln.bench.prompts import suite_names
from kiln.bench.report import write_reports
from kiln.bench.runner import BenchSettings, RunResult
from kiln.bench.summary import markdown_table, rows_of
from kiln.profiles import Probe, load_profile, shipped_profiles


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "matrix":
        return run_matrix_command(args)
    return run_one(args)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    lanes = ["performance", "quality"] if args.lane == "all" else [args.lane]
    return BenchSettings(
        suites=suite_names(args.suite),
        sizes=args.sizes,
        output_tokens=args.output_tokens,
        concurrency=args.concurrency,
        repetitions=args.repetitions,
        passes=args.passes,
        request_timeout=args.request_timeout,
        max_retries=args.max_retries,
        tolerance_percent=args.input_size_tolerance_percent,
        warmup=not args.no_warmup,
        ignore_eos=not args.no_ignore_eos,
        text_checks=not args.random_weights,
        lanes=lanes,
        tokenizer=args.tokenizer,
    )


def _out_dir(args: argparse.Namespace) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return args.output or os.path.join("bench-results", stamp)


def run_one(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    settings.check()
    probes, label = (), args.profile or "server"
    if args.profile and (args.profile.endswith(".toml") or args.profile in shipped_profiles()):
        profile = load_profile(args.profile)
        probes, label = profile.probes, profile.name
    results = run_client(_run(args, settings, label, probes))
    return _finish(results, _out_dir(args), f"kiln bench run: {label}")


async def _run(
    args: argparse.Namespace, settings: BenchSettings, label: str, probes: tuple[Probe, ...]
) -> list[RunResult]:
    client = OpenAIClient(args.base_url, args.model or "", args.api_key, settings.request_timeout)
    try:
        if not args.model:
            client.model = await served_model(client)
        return await bench_server(client, settings, label, probes, not args.no_progress)
    finally:
        await client.aclose()


def run_matrix_command(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    settings.check()
    profiles = matrix_profiles(args.configs, args.cudagraph_modes, args.profile)
    out_dir = _out_dir(args)
    results = run_matrix(
        profiles, args.model, settings, out_dir, args.boot_timeout, not args.no_progress
    )
    names = ", ".join(p.name for p in profiles)
    return _finish(results, out_dir, f"kiln bench matrix: {names}")


def _finish(results: list[RunResult], out_dir: str, title: str) -> int:
    paths = write_reports(results, out_dir, title)
    rows = [r for res in results for r in rows_of(res)]
    for res in results:
        for p in res.probes:
            mark = "pass" if p.passed else "FAIL"
            print(f"probe {mark} [{res.config}]: {p.prompt!r} -> {p.answer!r}")
    if rows:
        print(markdown_table(rows, with_deltas=len(results) > 1))
        passes = markdown_passes(rows)
        if passes:
            print(f"\npasses on one server:\n{passes}")
    print("reports: " + ", ".join(paths.values()))
    probes_ok = all(res.probes_passed is not False for res in results)
    return 0 if probes_ok and all(r.valid for r in rows) else 1  # 1: some result is invalid
