"""Pooling the final hidden states of pooling requests (the runner's side of `runner="pooling"`).

A pooling request is prefill only: every chunk of its prompt is a row with `StepRow.pooling`
set. LAST reads the last prompt position of the chunk that reaches the end; MEAN, CLS and ALL
(the token_embed task) read positions from every chunk, kept here per request until its last
chunk, so a prompt split over steps (chunked prefill) pools exactly the states of an unsplit one.
Then the first `dimensions` values are kept (Matryoshka) and the vector is L2-normalized when
asked, or (task classify) the model's classifier head and its activation give class
probabilities; the result is a float32 CPU tensor.

NOTE: a recomputed request (preempted, then prefilled again from position 0) starts over: a row
starting at 0 drops what was kept for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.core.step_input import StepRow


class Pooler:
    """Pools the rows of pooling requests; holds the partial states of prompts split across
    steps (keyed by request id)."""

    def __init__(self) -> None:
        self._partial: dict[str, list[torch.Tensor]] = {}

    def drop(self, request_ids) -> None:
        """Forget requests that ended (finished or aborted)."""
        for request_id in request_ids:
            self._partial.pop(request_id, None)

    @property
    def num_partial(self) -> int:
        return len(self._partial)

    def pool(self, rows: list[StepRow], hidden: torch.Tensor, starts: list[int],
             classifier=None) -> dict[int, torch.Tensor]:
        """`{row index: pooled tensor}` for the pooling rows that reach their prompt's end;
        `hidden` [T, H] is the step's final hidden states, row i's at `starts[i]` onwards;
        `classifier` maps pooled states [S, H] to logits [S, labels] (rows with `classify`)."""
        out: dict[int, torch.Tensor] = {}
        for idx, row in enumerate(rows):
            spec = row.pooling
            if spec is None:
                continue
            h = hidden[starts[idx] : starts[idx] + row.num_tokens]  # [n, H]
            if spec.pooling_type == "LAST":
                if row.do_sample:
                    out[idx] = self._finish(h[-1].float(), spec, classifier)
                continue
            if row.start == 0:
                self._partial[row.request_id] = []
            kept = self._partial.setdefault(row.request_id, [])
            # NOTE: a copy: the hidden states' buffer may be reused (CUDA graphs, the next step).
            if spec.pooling_type == "CLS":  # the first prompt position only
                h = h[:1] if row.start == 0 else h[:0]
            kept.append(h.to(torch.float32, copy=True))
            if not row.do_sample:
                continue
            states = torch.cat(self._partial.pop(row.request_id))  # [P, H] (CLS: [1, H])
            if spec.pooling_type == "MEAN":
                vec = states.mean(dim=0)
            elif spec.pooling_type == "CLS":
                vec = states[0]
            else:  # ALL: one vector per prompt token
                vec = states
            out[idx] = self._finish(vec, spec, classifier)
        return out

    @staticmethod
    def _finish(vec: torch.Tensor, spec, classifier) -> torch.Tensor:
        if spec.classify is not None:
            logits = classifier(vec[None])[0]  # [labels] float32
            if spec.classify == "softmax":
                return logits.softmax(dim=-1).cpu()
            return (logits.sigmoid() if spec.classify == "sigmoid" else logits).cpu()
        if spec.dimensions is not None:
            vec = vec[..., : spec.dimensions]
        if spec.normalize:
            vec = F.normalize(vec, p=2, dim=-1)
        return vec.detach().to("cpu", torch.float32).contiguous()
