"""Boot probes: short greedy questions with known answers. A configuration that fails one
does not produce the right tokens, however fast it is."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kiln.bench.client import BenchError, OpenAIClient
from kiln.profiles import Probe


@dataclass
class ProbeResult:
    prompt: str
    expect: str
    answer: str
    passed: bool
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def probe_messages(probe: Probe) -> list[dict[str, str]]:
    """Exactly what the reference check in the tests feeds HF transformers."""
    return [{"role": "user", "content": probe.prompt}]


def answer_passes(answer: str, expect: str) -> bool:
    return expect.casefold() in answer.casefold()


async def run_probes(client: OpenAIClient, probes: tuple[Probe, ...]) -> list[ProbeResult]:
    results = []
    for probe in probes:
        try:
            answer, _ = await client.chat(probe_messages(probe), probe.max_tokens)
        except BenchError as exc:
            results.append(ProbeResult(probe.prompt, probe.expect, "", False, str(exc)))
            continue
        results.append(
            ProbeResult(probe.prompt, probe.expect, answer, answer_passes(answer, probe.expect))
        )
    return results
