"""The three report files of a benchmark: JSON (everything), Markdown (the table), PNG (plot)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
from dataclasses import asdict
from typing import Any

from kiln.bench.passes import markdown_passes, pass_trends
from kiln.bench.runner import RunResult
from kiln.bench.summary import Row, markdown_table, rows_of


def machine_info() -> dict[str, Any]:
    """The machine the benchmark ran on, without importing torch (a client needs none): the
    installed versions, and the GPUs nvidia-smi lists."""
    info = {
        "kiln_version": _installed("kiln-llm"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": _installed("torch"),
    }
    gpus = _nvidia_gpus()
    if gpus:
        info["cuda_device"] = gpus[0]
    return info


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def run_to_dict(run: RunResult) -> dict[str, Any]:
    return {
        "config": run.config,
        "base_url": run.base_url,
        "model": run.model,
        "run_id": run.run_id,
        "settings": asdict(run.settings),
        "token_count_method": run.count_method,
        "duration_s": run.duration_s,
        "server": run.server,
        "probes": [p.to_dict() for p in run.probes],
        "prompts": [
            {k: v for k, v in asdict(p).items() if k != "excerpt"} | {"chars": len(p.excerpt)}
            for p in run.prompts
        ],
        "rows": [r.to_dict() for r in rows_of(run)],
        "rounds": [asdict(r) | {"output_tok_s": r.output_tok_s} for r in run.rounds],
        "trials": [t.to_dict() for t in run.trials],
    }


def write_reports(runs: list[RunResult], out_dir: str, title: str) -> dict[str, str]:
    """Writes report.json, report.md and report.png; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    rows = [r for run in runs for r in rows_of(run)]
    paths = {k: os.path.join(out_dir, f"report.{k}") for k in ("json", "md", "png")}
    doc = {
        "title": title,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": machine_info(),
        "runs": [run_to_dict(run) for run in runs],
        "table": markdown_table(rows, with_deltas=len(runs) > 1),
        "passes": [t.as_dict() for t in pass_trends(rows)],
    }
    _write_atomic(paths["json"], json.dumps(doc, indent=1, default=str))
    _write_atomic(paths["md"], markdown_report(runs, rows, title, doc["machine"]))
    plot_rows(rows, paths["png"], title)
    return paths


PASSES_NOTE = (
    "The same load again and again on one server. A pass moves by a few percent on its own on a "
    "shared machine, and the machine drifts over minutes, either way; a server that slows down "
    "over its life is below zero in every series. The fitted change (a least-squares line "
    "through every pass) says more than the last pass against the first; its error treats the "
    "passes as independent, which drift is not, so it is a lower bound."
)


def markdown_report(
    runs: list[RunResult], rows: list[Row], title: str, machine: dict[str, Any]
) -> str:
    s = runs[0].settings
    lines = [
        f"# {title}",
        "",
        f"kiln {machine['kiln_version']}, torch {machine['torch']}, "
        f"{machine.get('cuda_device') or machine['processor']} ({machine['cpu_count']} CPUs). "
        f"Output {s.output_tokens} tokens, {s.repetitions} repetitions"
        f"{f', {s.passes} passes per server' if s.passes > 1 else ''}, prompt size tolerance "
        f"{s.tolerance_percent}%, cold protocol (unique tag per request), "
        f"warm-up {'on' if s.warmup else 'off'}. Medians over valid trials.",
        "",
        markdown_table(rows, with_deltas=len(runs) > 1),
        "",
    ]
    passes = markdown_passes(rows)
    if passes:
        lines += ["## Passes on one server", "", PASSES_NOTE, "", passes, ""]
    for run in runs:
        lines += _run_notes(run)
    return "\n".join(lines) + "\n"


def _run_notes(run: RunResult) -> list[str]:
    lines = [f"## {run.config}", ""]
    if run.error is not None:
        return [*lines, f"- FAILED: {run.error}", ""]
    if run.server.get("boot_s") is not None:
        lines.append(f"- boot: {run.server['boot_s']:.1f} s to healthy")
    plan = run.server.get("graph_plan")
    if plan:
        lines.append(
            f"- graph plan: mode {plan.get('mode')}, decode {plan.get('decode_mode')}, "
            f"mixed {plan.get('mixed_mode')}; changes: "
            + ("; ".join(c.get("reason", "") for c in plan.get("changes", [])) or "none")
        )
    capture = run.server.get("capture")
    if capture:
        lines.append(
            f"- CUDA graphs: {capture.get('graphs', 0)} captured in "
            f"{capture.get('seconds', 0):.1f} s, {capture.get('memory_bytes', 0) / 2**30:.2f} GiB"
        )
    spec = run.server.get("spec_decode")
    if spec:
        per_pos = ", ".join(f"{a:.0%}" for a in spec["acceptance_per_position"])
        method = f" ({spec['method']})" if spec.get("method") else ""
        lines.append(
            f"- speculative decoding{method}: acceptance {spec['acceptance_rate']:.1%} of "
            f"{spec['num_draft_tokens']} draft tokens, mean accepted length "
            f"{spec['mean_accepted_length']:.2f}, per position {per_pos}"
        )
    if run.count_method:
        lines.append(f"- prompt tokens counted by: {run.count_method}")
    if any(t.record.usage_source == "client" for t in run.trials):
        lines.append(
            "- the server's streams carried no `usage`: prompt tokens counted as above, "
            "completion tokens = streamed text chunks"
        )
    for p in run.probes:
        mark = "pass" if p.passed else "FAIL"
        lines.append(f"- probe {mark}: {p.prompt!r} expects {p.expect!r}, got {p.answer!r}")
    return [*lines, ""]


def plot_rows(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r.config for r in rows))
    groups = list(dict.fromkeys((r.suite, r.size, r.concurrency) for r in rows))
    by_key = {(r.config, r.suite, r.size, r.concurrency): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(groups) + 4), 4.5))
    width = 0.8 / max(1, len(configs))
    for ax, attr, label in (
        (axes[0], "generation_tok_s", "generation tok/s (higher is better)"),
        (axes[1], "ttft_s", "TTFT s (lower is better)"),
    ):
        for i, cfg in enumerate(configs):
            values = [getattr(by_key.get((cfg, *g)), attr, None) or 0.0 for g in groups]
            xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(groups))]
            ax.bar(xs, values, width, label=cfg)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{s} {n}\nc={c}" for s, n, c in groups], fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path + ".tmp", dpi=110, format="png")
    plt.close(fig)
    os.replace(path + ".tmp", path)


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
