"""`kiln bench` end to end against real kiln servers with the embedded model: a valid row and
all three report files from `run`; a side-by-side table from `matrix` over two configurations,
each booted fresh (one of them through the external-engine launcher path)."""

from __future__ import annotations

import json
import os

import pytest

from kiln.cli.main import main
from tests.server_helpers import ServerProcess


@pytest.fixture(scope="module")
def baseline_server(smollm_path):
    srv = ServerProcess("--profile", "smollm2-baseline", "--kv-cache-memory", "512MiB")
    yield srv
    srv.stop()


def test_bench_run_produces_a_valid_row_and_three_reports(baseline_server, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "bench", "run", "--base-url", baseline_server.base, "--profile", "smollm2-baseline",
            "--suite", "regular", "--sizes", "512", "--output-tokens", "64",
            "--repetitions", "1", "--output", str(out), "--no-progress",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert {"report.json", "report.md", "report.png"} <= set(os.listdir(out))
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "report.json").read_text())
    run = doc["runs"][0]
    assert run["token_count_method"] == "server /tokenize (messages)"
    assert [p["passed"] for p in run["probes"]] == [True, True]
    (row,) = run["rows"]
    assert row["valid"] and row["suite"] == "regular" and row["size"] == 512
    assert abs(row["prompt_tokens"] - 512) <= 512 * 0.05
    assert row["generation_tok_s"] > 0 and row["ttft_s"] > 0 and row["itl_p99_ms"] > 0
    (trial,) = run["trials"]
    assert trial["record"]["completion_tokens"] == 64 and trial["record"]["cached_tokens"] == 0
    assert run["server"]["graph_plan"]["requested"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert run["server"]["boot"]["boot_s"] > 0
    assert doc["machine"]["kiln_version"]
    md = (out / "report.md").read_text()
    assert "| smollm2-baseline | regular 512 | 1 |" in md and "| Yes |" in md
    assert "| Yes |" in printed


def test_bench_run_second_time_is_still_cold(baseline_server, tmp_path, capsys):
    """The same prompt again: the unique tags keep the prefix cache from hitting."""
    args = [
        "bench", "run", "--base-url", baseline_server.base, "--suite", "coding",
        "--sizes", "256", "--output-tokens", "8", "--repetitions", "2",
        "--lane", "performance", "--no-progress",
    ]  # fmt: skip
    for i in range(2):
        assert main([*args, "--output", str(tmp_path / str(i))]) == 0
    doc = json.loads((tmp_path / "1" / "report.json").read_text())
    assert all(t["record"]["cached_tokens"] == 0 for t in doc["runs"][0]["trials"])
    assert doc["runs"][0]["probes"] == []  # the performance lane alone


def test_bench_run_passes_report_each_pass_against_the_first(baseline_server, tmp_path, capsys):
    """--passes 2: the same load twice on one server, one row per pass with its deltas
    against the first (the aggregate rate's too), the probes in the first pass only."""
    out = tmp_path / "passes"
    code = main(
        [
            "bench", "run", "--base-url", baseline_server.base, "--profile", "smollm2-baseline",
            "--suite", "coding", "--sizes", "256", "--output-tokens", "8", "--repetitions", "1",
            "--concurrency", "2", "--passes", "2", "--output", str(out), "--no-progress",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    doc = json.loads((out / "report.json").read_text())
    first, second = doc["runs"]
    assert [first["config"], second["config"]] == [
        "smollm2-baseline pass 1/2",
        "smollm2-baseline pass 2/2",
    ]
    assert [p["passed"] for p in first["probes"]] == [True, True] and second["probes"] == []
    assert all(t["record"]["cached_tokens"] == 0 for t in second["trials"])  # still cold
    (row,) = [ln for ln in printed.splitlines() if ln.startswith("| smollm2-baseline pass 2/2")]
    delta_aggregate = row.split("|")[-3].strip()
    assert delta_aggregate.endswith("%") and delta_aggregate != "-"
    assert "2 passes per server" in (out / "report.md").read_text()
    (trend,) = doc["passes"]  # the two passes' summary, printed and in both reports
    assert trend["config"] == "smollm2-baseline" and len(trend["rates"]) == 2
    assert trend["last_vs_first"] == pytest.approx(trend["rates"][1] / trend["rates"][0] - 1)
    assert "| smollm2-baseline | coding 256 | 2 |" in printed
    assert "## Passes on one server" in (out / "report.md").read_text()


def test_bench_run_unreachable_server_is_a_clear_error(tmp_path, capsys):
    code = main(["bench", "run", "--base-url", "http://127.0.0.1:9", "--output", str(tmp_path)])
    assert code == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


SMALL_SERVE = """
[serve]
max_model_len = 2048
max_num_seqs = 4
kv_cache_memory = "256MiB"
compilation_config = { mode = 0, cudagraph_mode = "NONE" }
"""


def test_bench_matrix_two_configurations(smollm_path, tmp_path, capsys):
    a = tmp_path / "eager-a.toml"
    a.write_text(
        'name = "eager-a"\nmodel = "default"\n' + SMALL_SERVE
        + '[[probes]]\nprompt = "What is the capital of France?"\nexpect = "Paris"\n'
    )  # fmt: skip
    b = tmp_path / "external-b.toml"
    b.write_text(
        'name = "external-b"\nengine = "external"\ncommand = ["{python}", "-m", "kiln", '
        '"serve", "{model}", "--port", "{port}", "--max-model-len", "2048", '
        '"--kv-cache-memory", "256MiB", "--block-size", "32"]\n'
    )
    out = tmp_path / "matrix"
    code = main(
        [
            "bench", "matrix", "--configs", str(a), str(b), "--suite", "regular",
            "--sizes", "128", "--output-tokens", "16", "--repetitions", "1",
            "--output", str(out), "--no-progress",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "Δ generation" in printed
    lines = [
        ln
        for ln in printed.splitlines()
        if ln.startswith("| eager-a") or ln.startswith("| external-b")
    ]
    # concurrency 1 has no aggregate rate: its delta is "-"
    assert len(lines) == 2 and lines[0].endswith("| +0.0% | +0.0% | - | +0.0% |")
    doc = json.loads((out / "report.json").read_text())
    first, second = doc["runs"]
    assert [r["config"] for r in doc["runs"]] == ["eager-a", "external-b"]
    for run in doc["runs"]:
        assert run["rows"][0]["valid"], run["rows"][0]["why_not"]
        assert run["server"]["boot_s"] > 0 and run["server"]["exit_code"] == 0
        assert os.path.isfile(run["server"]["log"])
        assert [p["passed"] for p in run["probes"]] == [True]  # the borrowed probe set too
    assert first["server"]["graph_plan"]["mode"] == 0
    assert not os.path.exists(first["server"]["fresh_compile_cache"])  # removed afterwards
    assert second["server"]["command"][-1] == "32"
    assert {"report.md", "report.png"} <= set(os.listdir(out))


def test_bench_matrix_reports_a_configuration_that_cannot_boot(tmp_path, capsys):
    bad = tmp_path / "broken.toml"
    bad.write_text(
        'name = "broken"\nengine = "external"\n'
        'command = ["{python}", "-c", "import sys; print(\'no GPU here\'); sys.exit(3)"]\n'
    )
    out = tmp_path / "m"
    code = main(
        ["bench", "matrix", "--configs", str(bad), "--sizes", "128", "--suite", "coding",
         "--output", str(out), "--no-progress"]
    )  # fmt: skip
    assert code == 1
    assert "No: server_failed x1" in capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert "FAILED: the server exited with status 3 during boot" in md and "no GPU here" in md


CRASHING_SERVER = """
import http.server, json, os, signal, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/v1/models":
            print("crashing on", self.path, flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_bench_matrix_says_how_a_server_died_after_boot(tmp_path, capsys):
    """A server that boots, then crashes (as llama.cpp's did on an AMX Xeon, a general
    protection fault in its CPU backend): the row's error names the signal and quotes the log,
    where the client alone saw a refused connection."""
    script = tmp_path / "crashing_server.py"
    script.write_text(CRASHING_SERVER)
    profile = tmp_path / "crashing.toml"
    command = f'["{{python}}", "{script}", "{{port}}"]'
    profile.write_text(f'name = "crashing"\nengine = "external"\ncommand = {command}\n')
    out = tmp_path / "m"
    code = main(
        ["bench", "matrix", "--configs", str(profile), "--sizes", "128", "--suite", "coding",
         "--output", str(out), "--no-progress"]
    )  # fmt: skip
    assert code == 1
    assert "No: server_failed x1" in capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert "the server had exited with signal SIGSEGV" in md and "crashing on" in md
