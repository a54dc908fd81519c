"""The engine's side of speculative decoding: before each step, drafts for the sequences that
decode (none when the step runs more sequences than `disable_by_batch_size`), and after it,
the acceptance statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kiln.config.speculative import SpeculativeConfig
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.sequence import Sequence
from kiln.errors import ConfigError
from kiln.models.config import ModelConfig
from kiln.spec.ngram import propose_ngram


def verified_tokens_per_seq(config: SpeculativeConfig | None) -> int:
    """Tokens a speculating sequence computes in a step: its last one and k drafts."""
    return 1 + config.num_speculative_tokens if config is not None else 1


def check_speculation(config: SpeculativeConfig | None, model: ModelConfig) -> None:
    """Refuse what this model cannot speculate with, naming what can."""
    if config is None:
        return
    if config.method == "mtp" and not model.is_hybrid:  # the hybrids' checkpoints carry one
        raise ConfigError(
            f'"method": "mtp" needs a model with MTP (mtp.*) weights; {model.architecture} has '
            'none. Use "ngram" or "draft_model"'
        )


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]
    num_disabled_steps: int = 0  # steps that ran more sequences than disable_by_batch_size
    draft_s: float = 0.0  # proposing
    verify_s: float = 0.0  # the steps that verified drafts, model and sampling

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying sequence gains per step: its accepted drafts and one more."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dict(vars(self))
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        d["acceptance_per_position"] = [
            n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_position
        ]
        return d


class DraftModel(Protocol):
    """A model that drafts by decoding: a smaller model (kiln.runner.draft) or the
    checkpoint's MTP head (kiln.runner.mtp)."""

    def follow(
        self,
        seqs: list[Sequence],
        starts: list[int],
        new_tokens: dict[Sequence, list[int]],
        target_step: tuple[Any, torch.Tensor] | None,
    ) -> None:
        """After each target step: the sequences of its batch, their computed tokens before
        it, the tokens it kept for each, and the target's step inputs and hidden states."""
        ...

    def propose(
        self, seqs: list[Sequence], counts: list[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """`counts[i]` drafts for each sequence after its tokens, and for each sampled one the
        distributions [count, V] they were drawn from (None for greedy ones)."""
        ...

    def ready(self, seq: Sequence) -> bool:
        """Whether it can draft for `seq` now."""
        ...

    def graph_stats(self) -> dict[str, Any]:
        """Its own steps per runtime mode and graph misses."""
        ...

    def warmed_up(self) -> None:
        """The boot's warm-up is over: forget its steps, count later compilations."""
        ...

    def release_memory(self) -> None: ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, pad_drafts: bool) -> None:
        """`pad_drafts`: fill each n-gram proposal up to k tokens (with repeats of its last
        token), so that verification batches stay uniform for the plan's FULL decode graphs; a
        filler token is verified like any draft, so the output stays exact."""
        self.config, self.max_model_len, self.pad_drafts = config, max_model_len, pad_drafts
        k = config.num_speculative_tokens
        self.stats = SpecDecodeStats(accepted_per_position=[0] * k)
        self.draft_model: DraftModel | None = None  # draft_model and mtp: set by the boot

    def propose(self, running: list[Sequence]) -> None:
        """Set the drafts of every running sequence that decodes next step."""
        if len(running) > self.config.batch_size_limit:
            for seq in running:
                seq.spec_token_ids = []
            self.stats.num_disabled_steps += 1
            return
        start = time.perf_counter()
        for seq in running:
            seq.spec_token_ids = self._drafts(seq) if seq.num_uncomputed_tokens == 1 else []
        self.stats.draft_s += time.perf_counter() - start

    def _drafts(self, seq: Sequence) -> list[int]:
        """At most k, never past the context length, and none the request could not use
        (past max_tokens) unless the batch must stay uniform."""
        cfg, p = self.config, seq.params
        room = min(cfg.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        useful = room
        if p.max_tokens is not None:
            useful = min(room, p.max_tokens - seq.num_output_tokens - 1)
        limit = room if self.pad_drafts else useful
        if limit < 1:
            return []
        ids = seq.token_ids
        if cfg.method != "ngram":  # places: the drafter fills those scheduled
            return [ids[-1]] * limit if self.draft_model.ready(seq) else []
        drafts = propose_ngram(ids, max(useful, 0), cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if self.pad_drafts:
            drafts += [drafts[-1] if drafts else ids[-1]] * (limit - len(drafts))
        return drafts

    def draft(self, batch: ScheduledBatch) -> None:
        """After scheduling, with the draft model: the drafts of the scheduled places (the
        scheduler may have cut some), decoded now that their KV blocks exist."""
        if self.draft_model is None:
            return
        seqs = [s for s in batch.seqs if s.spec_token_ids]
        if not seqs:
            return
        start = time.perf_counter()
        counts = [len(s.spec_token_ids) for s in seqs]
        tokens, probs = self.draft_model.propose(seqs, counts)
        for seq, ids, q in zip(seqs, tokens, probs):
            seq.spec_token_ids, seq.spec_probs = ids, q
        self.stats.draft_s += time.perf_counter() - start

    def follow(
        self,
        seqs: list[Sequence],
        starts: list[int],
        new_tokens: dict[Sequence, list[int]],
        target_step: tuple[Any, torch.Tensor] | None,
    ) -> None:
        """After a target step (see DraftModel.follow), timed as drafting."""
        if self.draft_model is None:
            return
        start = time.perf_counter()
        self.draft_model.follow(seqs, starts, new_tokens, target_step)
        self.stats.draft_s += time.perf_counter() - start

    def record(self, num_drafts: list[int], num_rejected: list[int], seconds: float) -> None:
        """After a step that verified drafts: per sequence, how many it had and lost."""
        st = self.stats
        st.verify_s += seconds
        for k, lost in zip(num_drafts, num_rejected):
            if not k:
                continue
            accepted = k - lost
            st.num_drafts += 1
            st.num_draft_tokens += k
            st.num_accepted_tokens += accepted
            for j in range(accepted):
                st.accepted_per_position[j] += 1

    def report(self) -> dict[str, Any]:
        """The statistics, and with a draft model its runner's steps and graph misses."""
        out = self.stats.to_dict()
        if self.draft_model is not None:
            out["draft_graphs"] = self.draft_model.graph_stats()
        return out

    def reset(self) -> None:
        """After the boot's warm-up: no statistics, and a draft model's compilations from now
        on are recompilations."""
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.config.num_speculative_tokens)
        if self.draft_model is not None:
            self.draft_model.warmed_up()
