"""Rows of the report: one per (configuration, suite, size, concurrency), medians over the valid
trials only, and the side-by-side table (prompt tokens, prefill and generation tok/s, TTFT,
validity)."""

from __future__ import annotations

import collections
import statistics
from dataclasses import asdict, dataclass, field

from kiln.bench.runner import Round, RunResult, Trial


@dataclass
class Row:
    config: str
    suite: str
    size: int
    concurrency: int
    trials: int
    valid_trials: int
    prompt_tokens: float | None = None
    prefill_tok_s: float | None = None
    generation_tok_s: float | None = None
    ttft_s: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_s: float | None = None
    aggregate_output_tok_s: float | None = None
    aggregate_prompt_tok_s: float | None = None
    reasons: dict[str, int] = field(default_factory=dict)
    probes_passed: bool | None = None

    @property
    def valid(self) -> bool:
        return (
            self.trials > 0 and self.valid_trials == self.trials and self.probes_passed is not False
        )

    def why_not(self) -> str:
        parts = [f"{k} x{n}" for k, n in sorted(self.reasons.items())]
        if self.probes_passed is False:
            parts.append("probes failed")
        if self.valid_trials < self.trials:
            parts.insert(0, f"{self.valid_trials}/{self.trials} trials valid")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self) | {"valid": self.valid, "why_not": self.why_not()}


def final_attempts(trials: list[Trial]) -> list[Trial]:
    """A retried request counts by its last attempt."""
    last: dict[tuple, Trial] = {}
    for t in trials:
        key = (t.suite, t.size, t.concurrency, t.repetition, t.slot)
        if key not in last or t.attempt > last[key].attempt:
            last[key] = t
    return list(last.values())


def rows_of(result: RunResult) -> list[Row]:
    if result.error is not None:  # one invalid row per cell it should have filled
        s = result.settings
        cells = [(su, n, c) for su in s.suites for n in s.sizes for c in s.concurrency]
        return [Row(result.config, *cell, 0, 0, reasons={"server_failed": 1}) for cell in cells]
    groups: dict[tuple, list[Trial]] = collections.defaultdict(list)
    for t in final_attempts(result.trials):
        groups[(t.suite, t.size, t.concurrency)].append(t)
    rounds: dict[tuple, list[Round]] = collections.defaultdict(list)
    for r in result.rounds:
        rounds[(r.suite, r.size, r.concurrency)].append(r)
    return [
        _row(result, key, trials, rounds[key], result.probes_passed)
        for key, trials in groups.items()
    ]


def _median(values: list[float | None], scale: float = 1.0) -> float | None:
    present = [v * scale for v in values if v is not None]
    return statistics.median(present) if present else None


def _row(result: RunResult, key: tuple, trials: list[Trial], rounds, probes) -> Row:
    suite, size, conc = key
    valid = [t for t in trials if t.valid]
    reasons = collections.Counter(r for t in trials for r in t.reasons)
    m = [t.metrics for t in valid]
    row = Row(result.config, suite, size, conc, len(trials), len(valid), reasons=dict(reasons))
    row.probes_passed = probes
    row.prompt_tokens = _median([x.prompt_tokens for x in m])
    row.prefill_tok_s = _median([x.prefill_tok_s for x in m])
    row.generation_tok_s = _median([x.generation_tok_s for x in m])
    row.ttft_s = _median([x.ttft for x in m])
    row.itl_ms = _median([x.mean_itl for x in m], 1e3)
    row.tpot_ms = _median([x.tpot for x in m], 1e3)
    pct = [x.itl_percentiles() for x in m if x.itl]
    row.itl_p50_ms = _median([p["p50"] for p in pct], 1e3)
    row.itl_p90_ms = _median([p["p90"] for p in pct], 1e3)
    row.itl_p99_ms = _median([p["p99"] for p in pct], 1e3)
    row.e2e_s = _median([x.e2e for x in m])
    if conc > 1 and rounds:
        row.aggregate_output_tok_s = _median([r.output_tok_s for r in rounds])
        row.aggregate_prompt_tok_s = _median(
            [r.prompt_tokens / r.wall_s for r in rounds if r.wall_s > 0]
        )
    return row


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _delta(value: float | None, ref: float | None) -> str:
    if value is None or not ref:
        return "-"
    return f"{(value - ref) / ref * 100:+.1f}%"


HEADER = (
    "| Configuration | Suite | Conc | Prompt tokens | Prefill tok/s | Generation tok/s "
    "| TTFT s | ITL ms | Valid |"
)


def markdown_table(rows: list[Row], with_deltas: bool = False) -> str:
    """The table; with deltas, each row's change against the first
    configuration's row of the same suite, size and concurrency."""
    header, rule = HEADER, "|---|---|---|---|---|---|---|---|---|"
    if with_deltas:
        header += " Δ prefill | Δ generation | Δ aggregate | Δ TTFT |"
        rule += "---|---|---|---|"
    first = {}
    for r in rows:
        first.setdefault((r.suite, r.size, r.concurrency), r)
    lines = [header, rule]
    for r in rows:
        agg = f" (agg {r.aggregate_output_tok_s:.1f})" if r.aggregate_output_tok_s else ""
        valid = "Yes" if r.valid else f"No: {r.why_not()}"
        cells = [
            r.config,
            f"{r.suite} {r.size}",
            str(r.concurrency),
            _fmt(r.prompt_tokens, 0),
            _fmt(r.prefill_tok_s, 1),
            _fmt(r.generation_tok_s, 1) + agg,
            _fmt(r.ttft_s, 3),
            _fmt(r.itl_ms, 1),
            valid,
        ]
        if with_deltas:
            ref = first[(r.suite, r.size, r.concurrency)]
            cells += [
                _delta(r.prefill_tok_s, ref.prefill_tok_s),
                _delta(r.generation_tok_s, ref.generation_tok_s),
                _delta(r.aggregate_output_tok_s, ref.aggregate_output_tok_s),
                _delta(r.ttft_s, ref.ttft_s),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
