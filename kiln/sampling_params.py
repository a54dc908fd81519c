"""Per-request sampling parameters, with the names and defaults vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's plus the top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _bias_map(self.logit_bias)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", f"n must be >= 1, got {self.n}"),
            (
                self.temperature >= 0,
                "temperature",
                f"temperature must be >= 0, got {self.temperature}",
            ),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (
                self.top_k >= 0,
                "top_k",
                f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}",
            ),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty > 0,
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens",
                f"max_tokens must be >= 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (
                self.seed is None or -(2**63) <= self.seed < 2**63,
                "seed",
                f"seed must fit in a signed 64-bit integer, got {self.seed}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                all(isinstance(s, str) and s for s in self.stop),
                "stop",
                "stop must be a list of non-empty strings",
            ),
            (
                all(-100 <= b <= 100 for b in (self.logit_bias or {}).values()),
                "logit_bias",
                "logit_bias values must be in [-100, 100]",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate_for_vocab(self, vocab_size: int) -> None:
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            bad = [t for t in ids or () if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} token ids {bad} are outside the vocabulary [0, {vocab_size})", name
                )


def _bias_map(bias: dict) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise InvalidRequestError(
            'logit_bias must map token ids to numbers, e.g. {"50256": -100}', "logit_bias"
        ) from None
