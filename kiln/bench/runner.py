"""`kiln bench run`: the cold-protocol benchmark against one OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tqdm import tqdm

from kiln.bench.client import BenchError, OpenAIClient, StreamResult
from kiln.bench.probes import ProbeResult, run_probes
from kiln.bench.prompts import BenchPrompt, build_prompt, request_tag, skeleton
from kiln.bench.tokens import TokenCounter, make_counter
from kiln.bench.trial import StreamRecord, TrialMetrics, invalid_reasons, trial_metrics
from kiln.profiles import Probe


@dataclass
class BenchSettings:
    suites: list[str]
    sizes: list[int]
    output_tokens: int = 256
    concurrency: list[int] = field(default_factory=lambda: [1])
    repetitions: int = 3
    max_retries: int = 2
    tolerance_percent: float = 5.0
    warmup: bool = True
    ignore_eos: bool = True
    lanes: list[str] = field(default_factory=lambda: ["performance", "quality"])
    tokenizer: str | None = None
    text_checks: bool = True  # off for random weights, whose answers are noise by design
    passes: int = 1  # the whole performance lane again on the same server, each pass reported
    request_timeout: float = 600  # seconds a response may go without a byte (a long prefill)
    tokens_per_step: int = 1  # the most tokens one step streams (1 + k when speculating)

    def check(self) -> None:
        positive = {
            "--sizes": min(self.sizes, default=0),
            "--output-tokens": self.output_tokens,
            "--concurrency": min(self.concurrency, default=0),
            "--repetitions": self.repetitions,
            "--passes": self.passes,
        }
        for flag, value in positive.items():
            if value < 1:
                raise BenchError(f"{flag} must be at least 1")
        if self.request_timeout <= 0:
            raise BenchError("--request-timeout must be above 0 seconds")
        if self.max_retries < 0 or self.tolerance_percent <= 0:
            raise BenchError("--max-retries must be >= 0 and the tolerance above 0")


@dataclass
class Trial:
    suite: str
    size: int
    concurrency: int
    repetition: int
    slot: int
    attempt: int
    record: StreamRecord
    metrics: TrialMetrics
    reasons: list[str]

    @property
    def valid(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict[str, Any]:
        rec = asdict(self.record)
        rec["text"] = self.record.text
        return {
            "suite": self.suite,
            "size": self.size,
            "concurrency": self.concurrency,
            "repetition": self.repetition,
            "slot": self.slot,
            "attempt": self.attempt,
            "valid": self.valid,
            "reasons": self.reasons,
            "metrics": asdict(self.metrics),
            "record": rec,
        }


@dataclass
class Round:
    """`concurrency` requests sent together; the aggregate rates are over its wall time."""

    suite: str
    size: int
    concurrency: int
    repetition: int
    wall_s: float
    prompt_tokens: int
    completion_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class RunResult:
    config: str
    base_url: str
    model: str
    run_id: str
    settings: BenchSettings
    count_method: str = ""
    prompts: list[BenchPrompt] = field(default_factory=list)
    trials: list[Trial] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    probes: list[ProbeResult] = field(default_factory=list)
    duration_s: float = 0.0
    server: dict[str, Any] = field(default_factory=dict)  # boot time, engine info, ...
    error: str | None = None  # the configuration could not be benchmarked at all

    @property
    def probes_passed(self) -> bool | None:
        return all(p.passed for p in self.probes) if self.probes else None


async def run_benchmark(
    client: OpenAIClient,
    settings: BenchSettings,
    config: str,
    probes: tuple[Probe, ...] = (),
    show_progress: bool = True,
) -> RunResult:
    settings.check()
    t0 = time.monotonic()
    result = RunResult(config, client.base_url, client.model, secrets.token_hex(4), settings)
    if "quality" in settings.lanes:
        result.probes = await run_probes(client, probes)
    if "performance" in settings.lanes:
        await _performance_lane(client, settings, result, show_progress)
    result.duration_s = time.monotonic() - t0
    return result


async def run_passes(
    client: OpenAIClient,
    settings: BenchSettings,
    config: str,
    probes: tuple[Probe, ...] = (),
    show_progress: bool = True,
) -> list[RunResult]:
    """`settings.passes` runs of the benchmark against one server, each its own result
    ("CONFIG pass i/N" when there are several): a server that slows down from one identical
    load to the next shows it side by side. The probes run in the first pass only."""
    if settings.passes == 1:
        return [await run_benchmark(client, settings, config, probes, show_progress)]
    results = []
    for i in range(settings.passes):
        lanes = settings.lanes if i == 0 else [x for x in settings.lanes if x != "quality"]
        label = f"{config} pass {i + 1}/{settings.passes}"
        own = replace(settings, lanes=lanes)
        results.append(await run_benchmark(client, own, label, probes, show_progress))
    return results


async def _performance_lane(
    client: OpenAIClient, settings: BenchSettings, result: RunResult, show_progress: bool
) -> None:
    suite0 = settings.suites[0]
    counter = await make_counter(
        client, skeleton(suite0, request_tag(result.run_id, 0)), settings.tokenizer
    )
    result.count_method = counter.method
    tags = _TagSource(result.run_id)
    if settings.warmup:
        await _warm_up(client, suite0, tags)
    total = len(settings.suites) * len(settings.sizes) * sum(settings.concurrency)
    with tqdm(
        total=total * settings.repetitions,
        desc=f"{result.config}",
        unit="req",
        disable=not show_progress,
        leave=False,
    ) as bar:
        for suite in settings.suites:
            for size in settings.sizes:
                prompt = await _prompt(suite, size, counter, settings, result.run_id)
                result.prompts.append(prompt)
                for conc in settings.concurrency:
                    for rep in range(settings.repetitions):
                        await _round(client, counter, settings, result, prompt, conc, rep, tags)
                        bar.update(conc)


async def _prompt(
    suite: str, size: int, counter: TokenCounter, settings: BenchSettings, run_id: str
) -> BenchPrompt:
    return await build_prompt(suite, size, counter, settings.tolerance_percent, run_id)


class _TagSource:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.next_index = 1  # 0 is the sample tag prompts are sized with

    def take(self) -> str:
        self.next_index += 1
        return request_tag(self.run_id, self.next_index - 1)


async def _warm_up(client: OpenAIClient, suite: str, tags: _TagSource) -> None:
    res = await client.stream_chat(skeleton(suite, tags.take()), max_tokens=4)
    if res.error is not None:
        raise BenchError(f"the warm-up request failed: {res.error}")


async def _round(
    client: OpenAIClient,
    counter: TokenCounter,
    settings: BenchSettings,
    result: RunResult,
    prompt: BenchPrompt,
    conc: int,
    rep: int,
    tags: _TagSource,
) -> None:
    n_out = settings.output_tokens

    async def one(slot: int, attempt: int) -> Trial:
        messages = prompt.messages(tags.take())
        res = await client.stream_chat(messages, n_out, settings.ignore_eos)
        source = "server"
        if res.usage is None and res.error is None:
            res.usage = await _client_usage(counter, messages, res)
            source = "client"
        rec = _record(res, prompt, settings, source)
        key = (prompt.suite, prompt.target_tokens, conc, rep, slot, attempt)
        return Trial(
            *key,
            rec,
            trial_metrics(rec),
            invalid_reasons(rec, settings.text_checks, settings.tokens_per_step),
        )

    start = time.monotonic()
    trials = await asyncio.gather(*(one(slot, 0) for slot in range(conc)))
    wall = time.monotonic() - start
    result.rounds.append(
        Round(
            prompt.suite,
            prompt.target_tokens,
            conc,
            rep,
            wall,
            sum(t.record.prompt_tokens or 0 for t in trials),
            sum(t.record.completion_tokens or 0 for t in trials),
        )
    )
    for trial in trials:
        result.trials.append(trial)
        for attempt in range(1, settings.max_retries + 1):
            if trial.record.error is None:
                break
            trial = await one(trial.slot, attempt)  # a failed request is retried alone
            result.trials.append(trial)


async def _client_usage(counter: TokenCounter, messages, res: StreamResult) -> dict[str, int]:
    """For servers whose streams carry no usage (llama-cpp-python): the prompt counted the way
    every prompt here is sized, and one completion token per streamed text chunk (exact for
    servers that stream token by token, as llama.cpp does). Trials record the source."""
    return {"prompt_tokens": await counter.count(messages), "completion_tokens": len(res.chunks)}


def _record(
    res: StreamResult, prompt: BenchPrompt, settings: BenchSettings, usage_source: str
) -> StreamRecord:
    usage = res.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return StreamRecord(
        start=res.start,
        chunks=res.chunks,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=details.get("cached_tokens"),
        expected_output_tokens=settings.output_tokens,
        target_prompt_tokens=prompt.target_tokens,
        tolerance_percent=settings.tolerance_percent,
        error=res.error,
        usage_source=usage_source,
    )
