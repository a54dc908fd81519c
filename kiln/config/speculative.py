"""`--speculative-config`: vLLM's field names for speculative decoding, strictly validated.
Nothing here imports torch; what a method needs from the model (a shared vocabulary, MTP
weights) is checked when the engine is built."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, fields
from typing import Any

from kiln.errors import ConfigError

METHODS = ("ngram", "draft_model", "mtp")

# vLLM's defaults when neither bound is given
DEFAULT_PROMPT_LOOKUP = 5
# Above this many running sequences a step verifies no drafts: on the 2-core CPU, n-gram
# speculation on the embedded model stopped paying between 4 and 8 streams
# (docs/performance.md, "Speculative decoding").
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram: the shortest suffix looked up
    prompt_lookup_max: int | None = None  # ngram: the longest
    model: str | None = None  # draft_model: its path
    # no drafts in a step that runs more sequences than this (vLLM's name)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            close = difflib.get_close_matches(str(self.method), METHODS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown speculative method {self.method!r}{hint}; choose one of "
                f"{', '.join(METHODS)}"
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or k < 1:
            raise ConfigError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        self._check_ngram()
        if self.method == "draft_model" and not self.model:
            raise ConfigError(
                'method "draft_model" needs "model": the path of a draft model that shares '
                "the target's vocabulary"
            )
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f'"model" is for method "draft_model", not {self.method!r}')
        limit = self.disable_by_batch_size
        if limit is not None and (not _is_int(limit) or limit < 1):
            raise ConfigError(f"disable_by_batch_size must be an integer >= 1, got {limit!r}")

    def _check_ngram(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            if lo is not None or hi is not None:
                raise ConfigError(f"prompt_lookup_min/max are for method ngram, not {self.method}")
            return
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        lo = lo if lo is not None else (hi if hi is not None else DEFAULT_PROMPT_LOOKUP)
        hi = hi if hi is not None else lo
        if lo > hi:
            raise ConfigError(f"prompt_lookup_min {lo} is above prompt_lookup_max {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @property
    def batch_size_limit(self) -> int:
        limit = self.disable_by_batch_size
        return DEFAULT_DISABLE_BY_BATCH_SIZE if limit is None else limit

    @classmethod
    def from_json(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """Parse `--speculative-config` (a JSON object) or a dict; None and {} are off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        data = value if isinstance(value, dict) else _json_object(str(value))
        if not data:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            close = {n: difflib.get_close_matches(n, known, n=1) for n in unknown}
            hints = "".join(f"; {n!r}: did you mean {c[0]!r}?" for n, c in close.items() if c)
            raise ConfigError(
                f"unknown --speculative-config fields {unknown}{hints} (fields: "
                f"{', '.join(sorted(known))})"
            )
        for required in ("method", "num_speculative_tokens"):
            if required not in data:
                raise ConfigError(
                    f'--speculative-config needs "{required}", e.g. '
                    '\'{"method": "ngram", "num_speculative_tokens": 3}\''
                )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_object(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            '--speculative-config must be a JSON object, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 3}\''
        )
    return data
