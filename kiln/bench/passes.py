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
    config: str
    suite: str
    size: int
    concurrency: int
    rates: list[float]  # aggregate output tok/s (generation tok/s where there is none), by pass

    @property
    def last_vs_first(self) -> float:
        return self.rates[-1] / self.rates[0] - 1

    @property
    def fitted_change(self) -> tuple[float, float]:
        """The least-squares line's change from the first pass to the last and its standard
        error, both as fractions of the mean rate."""
        n, mean = len(self.rates), statistics.fmean(self.rates)
        passes = list(range(n))
        slope, intercept = statistics.linear_regression(passes, self.rates)
        if n < 3:
            return slope * (n - 1) / mean, math.nan
        residuals = [r - (intercept + slope * x) for x, r in zip(passes, self.rates)]
        spread_x = sum((x - (n - 1) / 2) ** 2 for x in passes)
        slope_se = math.sqrt(sum(e * e for e in residuals) / (n - 2) / spread_x)
        return slope * (n - 1) / mean, slope_se * (n - 1) / mean

    def as_dict(self) -> dict[str, object]:
        change, error = self.fitted_change
        return {
            **asdict(self),
            "last_vs_first": self.last_vs_first,
            "fitted_change": change,
            "fitted_change_se": None if math.isnan(error) else error,
            "spread": self.spread,
        }

    @property
    def spread(self) -> float:
        """(fastest - slowest) / mean."""
        return (max(self.rates) - min(self.rates)) / statistics.fmean(self.rates)


def pass_trends(rows: list[Row]) -> list[PassTrend]:
    """One trend per configuration, suite, size and concurrency measured in two passes or
    more (rows labelled "CONFIG pass i/N"), passes in order; rows without a rate are left out."""
    trends: dict[tuple[str, str, int, int], list[tuple[int, float]]] = {}
    for row in rows:
        label = PASS_LABEL.match(row.config)
        rate = row.aggregate_output_tok_s or row.generation_tok_s
        if label is None or not rate:
            continue
        key = (label["config"], row.suite, row.size, row.concurrency)
        trends.setdefault(key, []).append((int(label["index"]), rate))
    return [
        PassTrend(*key, rates=[rate for _, rate in sorted(found)])
        for key, found in trends.items()
        if len(found) > 1
    ]


def markdown_passes(rows: list[Row]) -> str:
    """The passes' summary table, or "" when no load ran in several passes."""
    trends = pass_trends(rows)
    if not trends:
        return ""
    lines = [
        "| Configuration | Suite | Conc | Rate by pass (tok/s) | Last vs first | "
        "Fitted change, first to last (± 1 s.e.) | Spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in trends:
        change, error = t.fitted_change
        fitted = f"{change:+.1%}" + ("" if math.isnan(error) else f" ± {error:.1%}")
        lines.append(
            f"| {t.config} | {t.suite} {t.size} | {t.concurrency} | "
            f"{', '.join(f'{r:.1f}' for r in t.rates)} | {t.last_vs_first:+.1%} | "
            f"{fitted} | {t.spread:.1%} |"
        )
    return "\n".join(lines)
