"""The `kiln` command, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys


def _kiln(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_with_the_embedded_model():
    res = _kiln("generate", "What is the capital of France?", "--max-tokens", "24")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_generate_raw_skips_the_template():
    res = _kiln("generate", "The capital of France is", "--raw", "--max-tokens", "4")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()


def test_bad_flag_is_one_clear_line():
    res = _kiln("generate", "hi", "--top-p", "2")
    assert res.returncode == 2
    assert res.stderr.strip() == "error: top_p must be in (0, 1], got 2.0"
    res = _kiln("generate", "hi", "--model", "/no/such/model.gguf")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "not found" in res.stderr
    res = _kiln("generate", "hi", "--kv-cache-memory", "1GiB", "--kv-cache-memory-fraction", "0.3")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "pass one" in res.stderr  # was: the byte count silently won


def test_a_cache_dir_kiln_cannot_write_is_one_clear_line(tmp_path):
    """The embedded model's GGUF tokenizer is converted into kiln's cache directory."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    res = subprocess.run(
        [sys.executable, "-m", "kiln", "generate", "hi", "--max-tokens", "1"],
        env={**os.environ, "KILN_CACHE_DIR": str(not_a_dir)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: kiln cannot write its cache directory")
    assert "set KILN_CACHE_DIR to a directory you can write" in res.stderr


def test_info_prints_architecture_and_config():
    res = _kiln("info", "--kv-cache-memory", "512MiB")
    assert res.returncode == 0, res.stderr
    for word in ("LlamaForCausalLM", "layers", "30", "max_model_len", "KV cache"):
        assert word in res.stdout
    rows = dict(line.split("  ", 1) for line in res.stdout.splitlines() if "  " in line)
    attention = rows["attention backend"].strip()  # with the kernels this machine took
    assert attention.startswith("cpu (") and "C++ " in attention
    assert attention.endswith("(CUDA graphs: never)")
    assert "load model" in rows["boot"] and "warm up" in rows["boot"]
    assert rows["compile cache"].strip() == "none (mode 0 compiles nothing)"
    assert rows["torch.compile"].strip() == "none (mode 0 compiles nothing)"
    assert rows["CUDA graphs"].strip() == "none captured"
    # the embedded file's weights as they sit in memory: Q4_1 linears and the Q8_0 embedding
    # packed, and the total near the 98 MB file (540 MB dequantized to float32)
    weights = [line for line in res.stdout.splitlines() if line.startswith("weights ")]
    assert any("Q4_1 -> int4 packed" in line for line in weights), weights
    assert any("Q8_0 -> int4 packed" in line and "two planes" in line for line in weights)
    assert rows["quantization"].strip() == (
        "auto (prefill weights: auto, packed activations: auto)"
    )
    resident = float(rows["resident weights"].split()[0])
    assert 90 < resident < 110, resident


def test_info_plan_only_boots_nothing(tmp_path):
    """The plan and the entry a compiled boot would use, in seconds: no weights, no compile."""
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path)}

    def info(*args):
        cmd = [sys.executable, "-m", "kiln", "info", "--plan-only", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    res = info("-O.mode=3", "-O.cudagraph_mode=FULL_DECODE_ONLY")
    assert res.returncode == 0, res.stderr
    rows = dict(line.split("  ", 1) for line in res.stdout.splitlines() if "  " in line)
    assert rows["compile cache"].strip().endswith("(not built: boot compiles it)")
    assert str(tmp_path / "compile") in rows["compile cache"]
    assert "KV cache" not in rows and "boot" not in rows  # nothing was allocated or booted
    assert "FULL_DECODE_ONLY -> NONE: the CPU has no CUDA graphs" in res.stderr  # the warning
    assert not (tmp_path / "compile").exists()
    res = info("-O.cudagraph_mode=FULL_DECODE_ONLY", "--strict-graphs")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "the CPU has no CUDA graphs" in res.stderr
    # a vLLM launcher's settings for machinery kiln lacks: told, and refused when strict
    vllm_only = ("-O.mode=3", "-O.pass_config.fuse_norm_quant=true", "-O.compile_sizes+=1,2")
    res = info(*vllm_only)
    assert res.returncode == 0, res.stderr
    assert "compile_sizes [1, 2] -> (unused): kiln compiles each piece once" in res.stdout
    assert 'pass_config {"fuse_norm_quant": true} -> (unused)' in res.stderr
    res = info(*vllm_only, "--strict-graphs")
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_dotted_compilation_flags_fold_into_the_json():
    """vLLM's `-O.field=value`, `--compilation-config.field value` and `field+` list items,
    merged over the JSON value, in any order."""
    from kiln.cli.dotted_args import merge_dotted, split_dotted
    from kiln.config import CompilationConfig

    argv = [
        "info",
        "-O",
        '{"mode": 3, "cudagraph_capture_sizes": [1]}',
        "-O.cudagraph_capture_sizes+=2,4",
        "--compilation-config.cudagraph_mode",
        "FULL_DECODE_ONLY",
        "--max-num-seqs",
        "8",
        "-O.cudagraph_capture_sizes+",
        "16",
        "-O.splitting_ops=[]",
    ]
    rest, dotted = split_dotted(argv)
    assert rest == [
        "info",
        "-O",
        '{"mode": 3, "cudagraph_capture_sizes": [1]}',
        "--max-num-seqs",
        "8",
    ]
    config = CompilationConfig.from_json(merge_dotted(rest[2], dotted))
    assert config == CompilationConfig(
        mode=3,
        cudagraph_mode="FULL_DECODE_ONLY",
        cudagraph_capture_sizes=(1, 2, 4, 16),
        splitting_ops=(),
    )
    _, dotted = split_dotted(["-O.mode=3"])
    assert CompilationConfig.from_json(merge_dotted(None, dotted)).mode == 3


def test_dotted_compilation_flags_from_the_command_line():
    res = _kiln("info", "-O.level=0", "-O.cudagraph_mode=PIECEWISE", "--kv-cache-memory", "512MiB")
    assert res.returncode == 0, res.stderr
    (row,) = [line for line in res.stdout.splitlines() if line.startswith("cudagraph_mode")]
    assert row.split()[1:] == ["PIECEWISE", "NONE"]  # requested, resolved (no graphs on a CPU)
    assert "'level' is vLLM's old spelling" in res.stderr
    for args, words in [
        (["-O.mode", "--kv-cache-memory", "512MiB"], "-O.mode needs a value"),
        (["-O.=3"], "name a field after the dot"),
        (["-O.cudagraph_modes=FULL"], "did you mean 'cudagraph_mode'?"),
        (["-O.mode=2"], "vLLM's DYNAMO_TRACE_ONCE) is not supported"),
    ]:
        res = _kiln("info", *args)
        assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr
    res = _kiln("cache", "ls", "-O.mode=3")
    assert res.returncode == 2 and "kiln cache takes no compilation config" in res.stderr


def test_chat_is_multi_turn():
    res = _kiln(
        "chat",
        "--max-tokens",
        "24",
        stdin="What is the capital of France?\nAnd what is 1 + 1?\n/exit\n",
    )
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "2" in res.stdout.split("Paris", 1)[1]
