"""The proposer of `"method": "mtp"`: the checkpoint's multi-token-prediction head
(kiln/models/mtp.py) with its own runner and KV cache, on the target's block ids.

It follows the target: after every target step it runs over the positions the target kept,
each with the token after it and the target's hidden state there, so its KV cache always holds
what the target's does. Its output at a sequence's last position predicts the first draft; each
further draft is one chained step that reads the head's own output hidden state in place of the
target's, at the next position (those entries are written again, from the target's hidden
states, once the target has verified them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.sequence import Sequence
from kiln.runner.draft import DraftView, RunnerProposer, draw_drafts
from kiln.runner.model_runner import ModelRunner
from kiln.runner.step_inputs import StepInputs


class ShiftedTokens:
    """A sequence's tokens from its second on, then `extra`: what the head reads at each
    position, without copying the history at every step."""

    def __init__(self, tokens: list[int], extra: list[int]) -> None:
        self.tokens, self.extra = tokens, extra

    def __len__(self) -> int:
        return len(self.tokens) - 1 + len(self.extra)

    def __getitem__(self, span: slice) -> list[int]:
        """The tokens at positions [start, stop) (the runner's only use)."""
        own = len(self.tokens) - 1
        start, stop = span.start, min(span.stop, len(self))
        head = self.tokens[start + 1 : min(stop, own) + 1]
        return head + self.extra[max(start - own, 0) : max(stop - own, 0)]


@dataclass(eq=False)
class MTPView(DraftView):
    """A sequence as the head's runner sees it: `token_ids` shifted by one (position p reads
    token p + 1), and the hidden state that comes with each token it computes now."""

    token_ids: ShiftedTokens  # type: ignore[assignment]
    hidden_in: torch.Tensor | None = None


class MTPProposer(RunnerProposer):
    def __init__(self, runner: ModelRunner, eos: frozenset[int], generator: torch.Generator):
        """`runner`: the head's, with a hidden-state input buffer."""
        self.runner, self.eos, self.generator = runner, eos, generator

    @staticmethod
    def ready(seq: Sequence) -> bool:
        """Whether the head has run up to the sequence's last computed position."""
        return seq.mtp_hidden is not None and seq.mtp_hidden[0] == seq.num_computed_tokens

    @torch.inference_mode()
    def follow(
        self,
        seqs: list[Sequence],
        starts: list[int],
        new_tokens: dict[Sequence, list[int]],
        target_step: tuple[StepInputs, torch.Tensor],
    ) -> None:
        """After a target step: run the head over the positions each sequence kept, from
        `starts[i]` (its computed tokens before the step) to its computed tokens now, with
        `new_tokens` (the step's kept tokens, not yet appended)."""
        inputs, hidden = target_step
        views, counts = [], []
        for seq, start, first in zip(seqs, starts, inputs.seq_starts):
            kept = seq.num_computed_tokens - start
            if kept < 1:
                continue
            shifted = ShiftedTokens(seq.token_ids, new_tokens.get(seq, []))
            views.append(MTPView(seq, shifted, start, hidden_in=hidden[first : first + kept]))
            counts.append(kept)
        if not views:
            return
        step, out = self.runner.forward_hidden(ScheduledBatch(views, counts))  # type: ignore[arg-type]
        for view, row in zip(step.sampling_seqs, out if out is not None else []):
            view.seq.mtp_hidden = (view.seq.num_computed_tokens, row)  # type: ignore[attr-defined]

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], counts: list[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        draws = [DraftView(s, list(s.token_ids), s.num_computed_tokens) for s in seqs]
        hidden = [s.mtp_hidden[1] for s in seqs]
        logits = self.runner.model.compute_logits(torch.stack(hidden))
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while True:
            tokens, q = draw_drafts(logits, [draws[i] for i in active], self.eos, self.generator)
            for i, t, row in zip(active, tokens, q):
                drafts[i].append(t)
                draws[i].token_ids.append(t)
                if row is not None:
                    probs[i].append(row)
            active = [i for i in active if len(drafts[i]) < counts[i]]
            if not active:
                break
            out = self._chain([seqs[i] for i in active], [drafts[i] for i in active],
                              [hidden[i] for i in active])  # fmt: skip
            for i, h in zip(active, out):
                hidden[i] = h
            logits = self.runner.model.compute_logits(out)
        return drafts, [torch.stack(p) if p else None for p in probs]

    def _chain(
        self, seqs: list[Sequence], drafts: list[list[int]], hidden: list[torch.Tensor]
    ) -> torch.Tensor:
        """One chained step: each sequence's latest draft at the position after its last
        computed one plus the drafts before it, with the head's previous output; the head's
        new output per sequence."""
        views = [
            MTPView(
                s,
                ShiftedTokens(s.token_ids, d),
                s.num_computed_tokens - 1 + len(d),
                hidden_in=h[None],
            )
            for s, d, h in zip(seqs, drafts, hidden)
        ]
        # every view samples: its rows come back in the batch's order
        _, out = self.runner.forward_hidden(ScheduledBatch(views, [1] * len(views)))  # type: ignore[arg-type]
        return out
