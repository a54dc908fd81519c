"""`kiln bench run | matrix`: the context benchmark of the field report, cold and validated."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import re


def parse_size(text: str) -> int:
    """'512', '1k' (1024), '16K', '1m' (1024*1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512, 1k, 16k)")
    scale = {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]
    return int(m.group(1)) * scale


def _suite_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", default="all", choices=["regular", "coding", "all"])
    p.add_argument("--lane", default="all", choices=["performance", "quality", "all"])
    p.add_argument(
        "--sizes", nargs="+", type=parse_size, default=[1024, 4096], help="prompt tokens (1k=1024)"
    )
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1])
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--max-retries", type=int, default=2, help="retries of a failed request")
    p.add_argument("--input-size-tolerance-percent", type=float, default=5.0)
    p.add_argument("--no-warmup", action="store_true", help="skip the small warm-up request")
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that reject it; lengths may then mismatch)",
    )
    p.add_argument("--tokenizer", help="count prompt tokens with this .gguf / HF dir locally")
    p.add_argument("--output", help="report directory (default bench-results/<time>)")
    p.add_argument("--no-progress", action="store_true")


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark a server: cold, validated, side by side")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    run = bsub.add_parser("run", help="benchmark one running OpenAI-compatible server")
    run.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    run.add_argument("--model", help="model id to send (default: the first in /v1/models)")
    run.add_argument(
        "--profile", help="the configuration's name; a kiln profile also gives the probes"
    )
    run.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    _suite_args(run)
    run.set_defaults(func=cmd_bench_run)

    matrix = bsub.add_parser("matrix", help="boot a fresh server per configuration, compare")
    matrix.add_argument("--model", help="model for every configuration (default: the profile's)")
    matrix.add_argument("--configs", nargs="+", default=[], help="profile names or .toml files")
    matrix.add_argument(
        "--cudagraph-modes",
        type=lambda s: [m.strip().upper() for m in s.split(",") if m.strip()],
        help="e.g. NONE,PIECEWISE,FULL: one configuration per mode from --profile",
    )
    matrix.add_argument("--profile", help="base profile for --cudagraph-modes")
    matrix.add_argument("--boot-timeout", type=float, default=900)
    _suite_args(matrix)
    matrix.set_defaults(func=cmd_bench_matrix)


def settings_from(args: argparse.Namespace):
    from kiln.bench.prompts import suite_names
    from kiln.bench.runner import BenchSettings

    lanes = ["performance", "quality"] if args.lane == "all" else [args.lane]
    return BenchSettings(
        suites=suite_names(args.suite),
        sizes=args.sizes,
        output_tokens=args.output_tokens,
        concurrency=args.concurrency,
        repetitions=args.repetitions,
        max_retries=args.max_retries,
        tolerance_percent=args.input_size_tolerance_percent,
        warmup=not args.no_warmup,
        ignore_eos=not args.no_ignore_eos,
        lanes=lanes,
        tokenizer=args.tokenizer,
    )


def _out_dir(args: argparse.Namespace) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return args.output or os.path.join("bench-results", stamp)


def cmd_bench_run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    settings.check()
    probes, label = (), args.profile or "server"
    if args.profile and (args.profile.endswith(".toml") or _is_shipped(args.profile)):
        from kiln.profiles import load_profile

        profile = load_profile(args.profile)
        probes, label = profile.probes, profile.name
    result = asyncio.run(_run(args, settings, label, probes))
    return _finish([result], _out_dir(args), f"kiln bench run: {label}")


async def _run(args, settings, label, probes):
    from kiln.bench.client import OpenAIClient
    from kiln.bench.matrix import engine_info, served_model
    from kiln.bench.runner import run_benchmark

    client = OpenAIClient(args.base_url, args.model or "", args.api_key)
    try:
        if not args.model:
            client.model = await served_model(client)
        info = await engine_info(client)
        result = await run_benchmark(client, settings, label, probes, not args.no_progress)
        result.server = info
        return result
    finally:
        await client.aclose()


def cmd_bench_matrix(args: argparse.Namespace) -> int:
    # every bench module is imported before the first server boots: a matrix runs for an hour,
    # and a module imported at its end would be whatever the checkout holds by then
    import kiln.bench.report
    import kiln.bench.summary  # noqa: F401
    from kiln.bench.matrix import matrix_profiles, run_matrix

    settings = settings_from(args)
    settings.check()
    profiles = matrix_profiles(args.configs, args.cudagraph_modes, args.profile)
    out_dir = _out_dir(args)
    results = run_matrix(
        profiles, args.model, settings, out_dir, args.boot_timeout, not args.no_progress
    )
    names = ", ".join(p.name for p in profiles)
    return _finish(results, out_dir, f"kiln bench matrix: {names}")


def _finish(results, out_dir: str, title: str) -> int:
    from kiln.bench.report import write_reports
    from kiln.bench.summary import markdown_table, rows_of

    paths = write_reports(results, out_dir, title)
    rows = [r for res in results for r in rows_of(res)]
    for res in results:
        for p in res.probes:
            mark = "pass" if p.passed else "FAIL"
            print(f"probe {mark} [{res.config}]: {p.prompt!r} -> {p.answer!r}")
    if rows:
        print(markdown_table(rows, with_deltas=len(results) > 1))
    print("reports: " + ", ".join(paths.values()))
    probes_ok = all(res.probes_passed is not False for res in results)
    return 0 if probes_ok and all(r.valid for r in rows) else 1  # 1: some result is invalid


def _is_shipped(name: str) -> bool:
    from kiln.profiles import shipped_profiles

    return name in shipped_profiles()
