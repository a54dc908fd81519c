"""Whether a server slows down over its life: the same load's passes on one server
(`--passes N`), summarised per configuration, suite, size and concurrency.

The last pass against the first compares two single samples, and on a shared machine one pass
moves by a few percent on its own. So beside it the summary fits a straight line through every
pass's rate (least squares) and gives the line's change from the first pass to the last, with
its standard error from the passes' scatter around the line. A server that slows down over its
life does so in every series, so its fitted change is below zero run after run; a shared
machine's own drift over minutes moves it either way. The error treats the passes as
independent, which such drift is not, so read it as a lower bound."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass

from kiln.bench.summary import Row

PASS_LABEL = re.compile(r"^(?P<config>.+) pass (?P<index>\d+)/(?P<total>\d+)$")


@dataclass
class PassTrend:
    """One load's rate over the passes of one server. `passes` are the pass numbers (from 1)
    that have a valid rate; a failed or invalid pass is left out, and the line is fitted at
    the pass numbers, so a gap stays a gap."""

    config: str
    suite: str
    size: int
    concurrency: int
    total: int  # passes run
    passes: list[int]
    rates: list[float]
    unit: str  # "aggregate" (output tok/s of the whole load) or "stream" (generation tok/s)

    @property
    def last_vs_first(self) -> float:
        return self.rates[-1] / self.rates[0] - 1

    @property
    def fitted_change(self) -> tuple[float, float]:
        """The least-squares line's change from the first pass to the last and its standard
        error, both as fractions of the mean rate (the last against the first is a fraction
        of the first's)."""
        n, mean = len(self.rates), statistics.fmean(self.rates)
        slope, intercept = statistics.linear_regression(self.passes, self.rates)
        span = self.passes[-1] - self.passes[0]
        if n < 3:
            return slope * span / mean, math.nan
        residuals = [r - (intercept + slope * x) for x, r in zip(self.passes, self.rates)]
        centre = statistics.fmean(self.passes)
        spread_x = sum((x - centre) ** 2 for x in self.passes)
        slope_se = math.sqrt(sum(e * e for e in residuals) / (n - 2) / spread_x)
        return slope * span / mean, slope_se * span / mean

    @property
    def spread(self) -> float:
        """(fastest - slowest) / mean."""
        return (max(self.rates) - min(self.rates)) / statistics.fmean(self.rates)

    def as_dict(self) -> dict[str, object]:
        change, error = self.fitted_change
        return {
            **asdict(self),
            "last_vs_first": self.last_vs_first,
            "fitted_change": change,
            "fitted_change_se": None if math.isnan(error) else error,
            "spread": self.spread,
        }


def pass_trends(rows: list[Row]) -> list[PassTrend]:
    """One trend per configuration, suite, size and concurrency with a valid rate in two
    passes or more (rows labelled "CONFIG pass i/N"), in pass order. The rate is the aggregate
    output tok/s where every pass has one, else each stream's generation tok/s."""
    series: dict[tuple[str, str, int, int], list[tuple[int, int, Row]]] = {}
    for row in rows:
        label = PASS_LABEL.match(row.config)
        if label is not None and row.valid:
            key = (label["config"], row.suite, row.size, row.concurrency)
            series.setdefault(key, []).append((int(label["index"]), int(label["total"]), row))
    trends = [_trend(key, sorted(found, key=lambda f: f[0])) for key, found in series.items()]
    return [t for t in trends if t is not None]


def _trend(key: tuple[str, str, int, int], found: list[tuple[int, int, Row]]) -> PassTrend | None:
    found = [f for f in found if f[2].aggregate_output_tok_s or f[2].generation_tok_s]
    unit = "aggregate" if all(row.aggregate_output_tok_s for _, _, row in found) else "stream"
    rated = [
        (index, row.aggregate_output_tok_s if unit == "aggregate" else row.generation_tok_s)
        for index, _, row in found
    ]
    rated = [(index, rate) for index, rate in rated if rate]
    if len(rated) < 2:  # a series of one pass, or none: nothing to compare
        return None
    return PassTrend(
        *key,
        total=found[0][1],
        passes=[index for index, _ in rated],
        rates=[rate for _, rate in rated],
        unit=unit,
    )


def markdown_passes(rows: list[Row]) -> str:
    """The passes' summary table, or "" when no load ran in several passes."""
    trends = pass_trends(rows)
    if not trends:
        return ""
    lines = [
        "| Configuration | Suite | Conc | Rate by pass (tok/s) | Last vs first | "
        "Fitted change, first to last, of the mean (± 1 s.e.) | Spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in trends:
        change, error = t.fitted_change
        fitted = f"{change:+.1%}" + ("" if math.isnan(error) else f" ± {error:.1%}")
        lines.append(
            f"| {t.config} | {t.suite} {t.size} | {t.concurrency} | {_rates_by_pass(t)} | "
            f"{t.last_vs_first:+.1%} | {fitted} | {t.spread:.1%} |"
        )
    return "\n".join(lines)


def _rates_by_pass(trend: PassTrend) -> str:
    """Each pass's rate, "-" for a pass without a valid one; "(streams)" when the rates are
    each stream's generation tok/s rather than the load's aggregate."""
    by_pass = dict(zip(trend.passes, trend.rates))
    cells = [f"{by_pass[i]:.1f}" if i in by_pass else "-" for i in range(1, trend.total + 1)]
    return ", ".join(cells) + (" (streams)" if trend.unit == "stream" else "")
