"""Report rows from trials: medians over valid trials only, the last attempt of a retried
request, reasons counted, deltas against the first configuration; hand-computed values."""

from __future__ import annotations

import math

from kiln.bench.runner import BenchSettings, Round, RunResult, Trial
from kiln.bench.summary import final_attempts, markdown_table, rows_of
from kiln.bench.trial import StreamRecord, invalid_reasons, trial_metrics

WORDS = ["the", "keeper", "climbed", "the", "stairs", "at", "dusk"]


def _trial(rep: int, ttft: float, gap: float, attempt: int = 0, **kw) -> Trial:
    chunks = [(ttft + i * gap, f" {w}") for i, w in enumerate(WORDS[:5])]
    rec = StreamRecord(
        start=0.0,
        chunks=chunks,
        prompt_tokens=kw.pop("prompt_tokens", 1000),
        completion_tokens=5,
        cached_tokens=kw.pop("cached_tokens", 0),
        expected_output_tokens=5,
        target_prompt_tokens=1000,
        tolerance_percent=5.0,
        error=kw.pop("error", None),
    )
    return Trial("regular", 1000, 1, rep, 0, attempt, rec, trial_metrics(rec), invalid_reasons(rec))


def _run(config: str, trials: list[Trial]) -> RunResult:
    run = RunResult(config, "http://x", "m", "r", BenchSettings(["regular"], [1000]))
    run.trials = trials
    run.rounds = [Round("regular", 1000, 1, t.repetition, 2.0, 1000, 5) for t in trials]
    return run


def test_medians_use_valid_trials_only():
    trials = [
        _trial(0, 1.0, 0.1),
        _trial(1, 2.0, 0.2),
        _trial(2, 4.0, 0.3),
        _trial(3, 0.1, 0.01, cached_tokens=16),  # a cache hit: fastest, and invalid
    ]
    (row,) = rows_of(_run("a", trials))
    assert (row.trials, row.valid_trials) == (4, 3)
    assert row.ttft_s == 2.0  # median of 1, 2, 4: the invalid 0.1 is not counted
    assert math.isclose(row.generation_tok_s, 4 / 0.8)  # median of 4/0.4, 4/0.8, 4/1.2
    assert math.isclose(row.itl_ms, 200.0)
    assert math.isclose(row.prefill_tok_s, 500.0)  # 1000 tokens / 2 s
    assert not row.valid and row.why_not() == "3/4 trials valid, prompt_cache_hit x1"


def test_retried_request_counts_by_its_last_attempt():
    failed = _trial(0, 1.0, 0.1, error="HTTP 500: boom")
    retried = _trial(0, 3.0, 0.1, attempt=1)
    assert final_attempts([failed, retried]) == [retried]
    (row,) = rows_of(_run("a", [failed, retried]))
    assert row.valid and row.trials == 1 and row.ttft_s == 3.0


def test_failed_probes_make_a_row_invalid():
    from kiln.bench.probes import ProbeResult

    run = _run("a", [_trial(0, 1.0, 0.1)])
    run.probes = [ProbeResult("capital of France?", "Paris", "Lyon", False)]
    (row,) = rows_of(run)
    assert row.valid_trials == 1 and not row.valid and row.why_not() == "probes failed"


def test_table_deltas_against_the_first_configuration():
    rows = rows_of(_run("base", [_trial(0, 1.0, 0.1)])) + rows_of(
        _run("fast", [_trial(0, 0.5, 0.05)])
    )
    table = markdown_table(rows, with_deltas=True).splitlines()
    assert table[0].endswith("| Δ prefill | Δ generation | Δ aggregate | Δ TTFT |")
    assert table[2].startswith("| base | regular 1000 | 1 | 1000 | 1000.0 | 10.0 | 1.000 |")
    assert table[2].endswith("| Yes | +0.0% | +0.0% | - | +0.0% |")  # concurrency 1: no aggregate
    # twice the prefill and generation rates, half the TTFT
    assert table[3].endswith("| Yes | +100.0% | +100.0% | - | -50.0% |")


def test_bad_bench_flags_are_clear_errors(capsys):
    import pytest

    from kiln.cli.main import main

    cases = [
        (["--sizes", "0"], "--sizes must be at least 1"),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--passes", "0"], "--passes must be at least 1"),
        (["--request-timeout", "0"], "--request-timeout must be above 0 seconds"),
        (["--input-size-tolerance-percent", "0"], "tolerance above 0"),
        (["--profile", "missing.toml"], "does not exist"),
    ]
    for extra, message in cases:
        assert main(["bench", "run", "--base-url", "http://127.0.0.1:9", *extra]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "run", "--base-url", "x", "--sizes", "4g"])
    assert "not a size" in capsys.readouterr().err
    assert (
        main(["bench", "matrix", "--configs", "smollm2-baseline", "--cudagraph-modes", "FULL"]) == 2
    )
    assert "not both" in capsys.readouterr().err
    assert main(["bench", "matrix", "--cudagraph-modes", "SOMETIMES"]) == 2
    assert "cudagraph_mode 'SOMETIMES' is not one of" in capsys.readouterr().err


def test_a_configuration_that_failed_gets_invalid_rows():
    run = RunResult("broken", "", "m", "", BenchSettings(["regular", "coding"], [1000]))
    run.error = "the server exited with status 1 during boot"
    rows = rows_of(run)
    assert [(r.suite, r.valid, r.why_not()) for r in rows] == [
        ("regular", False, "server_failed x1"),
        ("coding", False, "server_failed x1"),
    ]
    assert "| broken | regular 1000 | 1 | - |" in markdown_table(rows)
