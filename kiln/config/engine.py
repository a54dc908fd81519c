"""Engine configuration: small frozen dataclasses, validated once at construction. Each option
field carries its command-line help (`option`), so the flat option list of the Python API,
the `kiln` flags and the launcher profiles are all derived from these fields (options.py):
a new option is added here, once. Nothing here imports torch."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kiln.config.compilation import CompilationConfig
from kiln.config.speculative import SpeculativeConfig
from kiln.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "t": 1e12,
    "tb": 1e12,
}


def parse_bytes(value: int | float | str) -> int:
    """Parse '2GiB', '512MB', '1e9' or a number of bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"cannot parse memory size {value!r}; use e.g. '2GiB', '512MB' or bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def option(
    kind: type | tuple[type, ...],
    help: str,
    *,
    negatable: bool = False,
    profile: bool = True,
    **cli: Any,
) -> dict[str, Any]:
    """A field's metadata as an option: the type a profile or the command line gives (`kind`),
    its help, whether a launcher profile may set it, and extra argparse settings (`choices`,
    `flags`). A bool option is a switch, `--[no-]name` when `negatable`."""
    meta = {"kind": kind, "help": help, "negatable": negatable, "profile": profile, **cli}
    return {"option": meta}


def _check_choices(config: Any) -> None:
    """Every option with `choices` holds one of them. argparse checks the command line; this
    checks the Python API and profiles, where a misspelt value would otherwise fall through to
    a default branch silently."""
    for f in fields(config):
        choices = f.metadata.get("option", {}).get("choices")
        value = getattr(config, f.name)
        if choices is not None and value not in choices:
            raise ConfigError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")


# Tokens per KV block when none is given. The CPU's attention kernels read each request's blocks
# in table order: larger blocks cost fewer lookups and leave fewer places where a server's
# interleaved allocations break the stream (a 64-stream decode step's attention 1.09x with blocks
# of 64 in order, 1.09x with them shuffled against 16 shuffled: docs/performance.md, "Block
# size on the CPU"), for prefix hits at 64-token granularity. CUDA keeps vLLM's 16.
DEFAULT_BLOCK_SIZE = {"cpu": 64, "cuda": 16}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = field(  # None: DEFAULT_BLOCK_SIZE for the device
        default=None,
        metadata=option(
            int,
            "tokens per KV block, a power of two; prefix caching shares whole blocks "
            "(default 64 on the CPU, 16 on CUDA)",
        ),
    )
    # At most one of the two budgets; neither: the device's default fraction of free memory.
    kv_cache_memory: int | None = field(
        default=None,
        metadata=option(
            (str, int), "KV cache budget, e.g. 2GiB (default: a fraction of free memory)"
        ),
    )
    kv_cache_memory_fraction: float | None = field(
        default=None,
        metadata=option(
            float, "fraction of free memory for the KV cache (default 0.2 CPU, 0.85 CUDA)"
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=option(
            str,
            "the KV cache's element type: auto (default: --dtype), float32, bfloat16, float16 "
            "or int8; bfloat16 under a float32 model halves the cache's memory and the bytes "
            "each decode step reads, keys and values rounded to bf16 as they are written; "
            "int8 (CPU attention backends) stores each token's head row as int8 values and "
            "one float32 scale, a quarter of float32's bytes",
        ),
    )
    kv_cache_prefault: bool = field(
        default=False,
        metadata=option(
            bool,
            "CPU: fault the whole KV cache in at boot, so that no step waits on fresh pages "
            "(first touch cost 1-2 s a GiB on a VM; a server's rounds on untouched blocks ran "
            "5 to 10 percent slower). Default off: a one-shot generate touches a few blocks",
            negatable=True,
        ),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=option(
            bool, "reuse KV blocks of shared prompt prefixes (default on)", negatable=True
        ),
    )

    state_checkpoints: int | None = field(  # None: as many as max_num_seqs
        default=None,
        metadata=option(
            int,
            "hybrid models with prefix caching: how many Gated DeltaNet states at block ends "
            "are kept for prefix hits, each the size of one sequence's state (default: "
            "max_num_seqs)",
        ),
    )

    def __post_init__(self) -> None:
        if self.state_checkpoints is not None and self.state_checkpoints < 1:
            raise ConfigError(
                f"state_checkpoints must be >= 1, got {self.state_checkpoints} (turn prefix "
                "caching off with --no-enable-prefix-caching instead)"
            )
        if self.kv_cache_dtype not in ("auto", "int8") and self.kv_cache_dtype not in DTYPES:
            raise ConfigError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose auto, int8 or one of "
                f"{sorted(DTYPES)}"
            )
        if isinstance(self.kv_cache_memory, str):
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        bs = self.block_size
        if bs is not None and (bs < 1 or bs & (bs - 1)):
            raise ConfigError(f"block_size must be a power of two >= 1, got {bs}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        frac = self.kv_cache_memory_fraction
        if frac is not None and not 0 < frac <= 1:
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {frac}")
        if frac is not None and self.kv_cache_memory is not None:
            raise ConfigError(
                "both kv_cache_memory and kv_cache_memory_fraction were given; pass one: "
                "--kv-cache-memory (bytes, e.g. 2GiB) or --kv-cache-memory-fraction"
            )

    def for_device(self, device_type: str) -> CacheConfig:
        """This config with the device's block size filled in."""
        if self.block_size is not None:
            return self
        size = DEFAULT_BLOCK_SIZE.get(device_type, DEFAULT_BLOCK_SIZE["cuda"])
        return replace(self, block_size=size)


# The step's token budget when none is given. On the CPU a prefill chunk stalls every running
# decode for as long as it runs, and smaller chunks also prefilled long prompts faster there
# (docs/performance.md, "The server under load").
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata=option(int, "sequences per step (default 64)"))
    max_num_batched_tokens: int | None = field(  # None: DEFAULT_BATCHED_TOKENS for the device
        default=None,
        metadata=option(
            int,
            "token budget per step, i.e. the prefill chunk (default 512 on the CPU, 2048 on CUDA)",
        ),
    )
    max_model_len: int | None = field(  # None: the model's own context length
        default=None, metadata=option(int, "context length (default: the model's)")
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def for_device(self, device_type: str) -> SchedulerConfig:
        """This config with the device's defaults filled in."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = DEFAULT_BATCHED_TOKENS.get(device_type, DEFAULT_BATCHED_TOKENS["cuda"])
        return replace(self, max_num_batched_tokens=budget)


# the names --dtype takes, each to torch's name of the dtype
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default model
    dtype: str = field(
        default="float32", metadata=option(str, "float32 (default), bfloat16 or float16")
    )
    quantization: str = field(
        default="auto",
        metadata=option(
            str,
            "auto (default): weights stored 4-bit (GGUF Q4_0, Q4_1, Q4_K, Q8_0) stay packed "
            "where an int4 kernel runs them, the rest is dequantized; none: dequantize every "
            "weight to --dtype",
            choices=("auto", "none"),
        ),
    )
    prefill_weights: str = field(
        default="auto",
        metadata=option(
            str,
            "packed weights of a bfloat16/float16 model on the CPU: auto (default) keeps a "
            "dense copy of each for batches of 16+ rows (prefill chunks, many streams) when "
            "the copies fit in a quarter of the free memory; dense: always; packed: never "
            "(every prefill chunk dequantizes the weights instead)",
            choices=("auto", "dense", "packed"),
        ),
    )
    cpu_linears: str = field(
        default="auto",
        metadata=option(
            str,
            "bf16 linears on the CPU: auto (default) runs them on kiln's C++ kernel where the "
            "CPU has AVX512-BF16 (on AMX tiles where it has them), else on oneDNN (BLAS where "
            "oneDNN has no bf16); "
            "onednn: as where the kernel does not run",
            choices=("auto", "onednn"),
        ),
    )
    packed_activations: str = field(
        default="auto",
        metadata=option(
            str,
            "how decode rows meet 4-bit packed weights on the CPU: auto (default): int16 "
            "where the CPU has AVX512-VNNI and VBMI, else float; float: float32 as they are; "
            "int16: two int8 planes per 32 columns, 16 bits of each value (products within "
            "1e-4 of float32's; kiln's kernel 1.6-1.9x faster with VNNI, level on AVX2); "
            "int8: one plane, as llama.cpp's CPU path does (products off by about 1 part in "
            "100; 2.4-2.9x with VNNI, 1.1-1.3x on AVX2)",
            choices=("auto", "float", "int16", "int8"),
        ),
    )
    device: str = field(default="auto", metadata=option(str, "auto (default), cpu or cuda[:N]"))
    seed: int = field(
        default=0, metadata=option(int, "engine seed for unseeded sampling (default 0)")
    )
    tokenizer: str | None = field(
        default=None,
        metadata=option(str, "an HF directory whose tokenizer replaces the model's own"),
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation: CompilationConfig = field(
        default_factory=CompilationConfig,
        metadata=option(
            (dict, str),
            'JSON, e.g. \'{"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}\' (vLLM\'s fields: '
            "mode, cudagraph_mode, cudagraph_capture_sizes, max_cudagraph_capture_size, "
            "splitting_ops, backend (inductor, aot_eager, eager), inductor_compile_config, "
            "debug_dump_path), or a field per flag as in vLLM: -O.mode=3 "
            "-O.cudagraph_capture_sizes+=1,2,4 -O.backend=eager",
            name="compilation_config",
            flags=("--compilation-config", "-O"),
        ),
    )
    speculative: SpeculativeConfig | None = field(
        default=None,
        metadata=option(
            (dict, str),
            'JSON, vLLM\'s fields: \'{"method": "ngram", "num_speculative_tokens": 3, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (drafts looked up in the '
            'request\'s own tokens), \'{"method": "draft_model", "model": PATH, '
            '"num_speculative_tokens": 3}\'; "disable_by_batch_size": N verifies no drafts in '
            "steps of more than N sequences (default 4). Greedy output is unchanged; sampled "
            "output keeps the model's distribution",
            name="speculative_config",
        ),
    )
    enforce_eager: bool = field(
        default=False, metadata=option(bool, "no torch.compile, no CUDA graphs")
    )
    strict_graphs: bool = field(  # every change the graph plan would make is an error
        default=False,
        metadata=option(
            bool, "refuse to start when the graph plan would change the requested config"
        ),
    )
    eager_step_padding: str = field(
        default="auto",
        metadata=option(
            str,
            "auto (default): on the CPU, a step run outside a graph is padded to a bounded set "
            "of token counts (exact to 8, then eight sizes per doubling), which keeps oneDNN's "
            "per-shape kernels and memory bounded; on: on every device; off: exact sizes",
            choices=("auto", "on", "off"),
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=option(
            str,
            "auto (default): triton on CUDA (capturable in FULL graphs), cpu on the CPU (reads "
            "the paged cache in place; decode rows through its C++ kernel); cpu-flash: cpu "
            "without that kernel; torch: the pure-PyTorch reference, on both",
            choices=("auto", "cpu", "cpu-flash", "torch", "triton"),
        ),
    )
    boot_timeout: float | None = field(  # seconds per boot phase; None or 0: no limit
        default=1800.0,
        metadata=option(
            float,
            "seconds each boot phase (load, plan, graph memory, KV cache, warm-up/compile, "
            "capture) may take before it is reported with its stack and stopped; 0 = no limit "
            "(default 1800)",
        ),
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        if not isinstance(self.speculative, (SpeculativeConfig, type(None))):
            object.__setattr__(self, "speculative", SpeculativeConfig.from_json(self.speculative))
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.boot_timeout is not None and self.boot_timeout < 0:
            raise ConfigError(
                f"boot_timeout must be >= 0 seconds (0: no limit), got {self.boot_timeout}"
            )
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
