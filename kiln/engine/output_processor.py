"""After sampling, per sequence: the new token, its timing and logprobs, its detokenized text,
and whether it stops (EOS, a stop token or string once past min_tokens, max_tokens, the
context length)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.sequence import Sequence
from kiln.loader.tokenizer import Tokenizer
from kiln.outputs import Logprobs, TokenLogprob


@dataclass
class OutputProcessor:
    tokenizer: Tokenizer
    max_model_len: int

    def append(
        self, seq: Sequence, token: int, logprob_row: torch.Tensor | None, now: float
    ) -> bool:
        """Append `token` to `seq` (sampled at monotonic time `now`, with the step's log-softmax
        row when logprobs were asked for); return whether `seq` finished with it."""
        seq.token_ids.append(token)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.metrics.token_times.append(now)
        if logprob_row is not None and seq.params.logprobs is not None:
            self._record_logprobs(seq, logprob_row, token)
        self._check_stop(seq, token)
        if seq.finish_reason is None:
            return False
        seq.metrics.finished_time = now
        return True

    def _record_logprobs(self, seq: Sequence, row: torch.Tensor, token: int) -> None:
        decode = self.tokenizer.decode
        top = []
        if seq.params.logprobs:
            values, ids = row.topk(seq.params.logprobs)
            top = [
                TokenLogprob(i, decode([i], False), v)
                for i, v in zip(ids.tolist(), values.tolist())
            ]
        lp = float(row[token])
        seq.logprobs.append(Logprobs(TokenLogprob(token, decode([token], False), lp), top))
        seq.cumulative_logprob += lp

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        past_min = seq.num_output_tokens >= p.min_tokens
        stop_str = seq.detokenizer.add_token(token, match_stop=past_min)
        if past_min and not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.finish_reason = "stop"
        elif past_min and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif (
            p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens
        ) or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
