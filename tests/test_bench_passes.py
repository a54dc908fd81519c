"""The passes' summary (kiln/bench/passes.py): which rows form a series, and the fitted change
against numpy's least-squares fit as the independent reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.bench.passes import markdown_passes, pass_trends
from kiln.bench.summary import Row


def _row(
    config: str, rate: float | None, concurrency: int = 16, generation: float = 5.0, valid: int = 1
) -> Row:
    return Row(
        config=config, suite="regular", size=512, concurrency=concurrency, trials=1,
        valid_trials=valid, generation_tok_s=generation, aggregate_output_tok_s=rate,
    )  # fmt: skip


def test_series_are_grouped_per_configuration_and_load_in_pass_order():
    rows = [
        _row("a pass 2/3", 98.0),
        _row("a pass 1/3", 100.0),
        _row("a pass 3/3", 96.0),
        _row("a pass 1/3", 50.0, concurrency=64),  # another load: its own series of one
        _row("b", 70.0),  # no passes
        _row("c pass 1/2", None, generation=9.0),  # no aggregate: the stream's rate
        _row("c pass 2/2", None, generation=9.9),
    ]
    trends = {t.config: t for t in pass_trends(rows)}
    assert sorted(trends) == ["a", "c"]
    assert trends["a"].rates == [100.0, 98.0, 96.0] and trends["a"].concurrency == 16
    assert trends["c"].rates == [9.0, 9.9] and trends["c"].unit == "stream"
    assert trends["a"].unit == "aggregate" and trends["a"].passes == [1, 2, 3]
    assert trends["c"].last_vs_first == pytest.approx(0.1)


def test_a_failed_or_invalid_pass_leaves_a_gap_the_line_is_fitted_across():
    rows = [
        _row("x pass 1/5", 100.0),
        _row("x pass 2/5", None, generation=None),  # failed: no rate at all
        _row("x pass 3/5", 80.0, valid=0),  # its requests failed validation
        _row("x pass 4/5", 99.0),
        _row("x pass 5/5", 90.0),
    ]
    (trend,) = pass_trends(rows)
    assert trend.passes == [1, 4, 5] and trend.rates == [100.0, 99.0, 90.0]
    slope, _ = np.polyfit([1, 4, 5], trend.rates, 1)
    assert trend.fitted_change[0] == pytest.approx(slope * 4 / np.mean(trend.rates))
    assert "| 100.0, -, -, 99.0, 90.0 |" in markdown_passes(rows)


def test_one_unit_per_series_the_streams_rate_where_a_pass_has_no_aggregate():
    rows = [_row("x pass 1/2", 100.0, generation=5.0), _row("x pass 2/2", None, generation=4.0)]
    (trend,) = pass_trends(rows)
    assert trend.unit == "stream" and trend.rates == [5.0, 4.0]
    assert "5.0, 4.0 (streams)" in markdown_passes(rows)


def test_fitted_change_matches_numpys_least_squares():
    rates = [215.9, 221.2, 209.0, 204.1, 207.5]
    trend = pass_trends([_row(f"x pass {i + 1}/5", r) for i, r in enumerate(rates)])[0]
    (slope, _), cov = np.polyfit(np.arange(5), rates, 1, cov="unscaled")
    residuals = np.array(rates) - np.polyval(np.polyfit(np.arange(5), rates, 1), np.arange(5))
    slope_se = math.sqrt(cov[0, 0] * (residuals @ residuals) / 3)
    change, error = trend.fitted_change
    assert change == pytest.approx(slope * 4 / np.mean(rates))
    assert error == pytest.approx(slope_se * 4 / np.mean(rates))
    assert trend.spread == pytest.approx((221.2 - 204.1) / np.mean(rates))
    assert trend.last_vs_first == pytest.approx(207.5 / 215.9 - 1)


def test_a_straight_line_has_no_error_and_two_passes_have_none_to_give():
    line = pass_trends([_row(f"x pass {i + 1}/4", 100.0 - 2 * i) for i in range(4)])[0]
    assert line.fitted_change == pytest.approx((-6 / 97, 0.0))
    two = pass_trends([_row("x pass 1/2", 100.0), _row("x pass 2/2", 90.0)])[0]
    change, error = two.fitted_change
    assert change == pytest.approx(-10 / 95) and math.isnan(error)
    assert two.as_dict()["fitted_change_se"] is None


def test_markdown_passes_is_empty_without_passes_and_a_table_with_them():
    assert markdown_passes([_row("b", 70.0)]) == ""
    table = markdown_passes([_row("a pass 1/2", 100.0), _row("a pass 2/2", 97.0)])
    assert "| a | regular 512 | 16 | 100.0, 97.0 | -3.0% |" in table
