"""The engine's side of structured outputs: compiled grammars, one xgrammar matcher per sequence,
the step's token bitmask, and advancing the matchers with each accepted token.

The matchers live in the request's `SequenceGroup.extra["grammar"]` (sequence id -> matcher), so
they go when the group goes, and survive preemption unchanged: a preempted sequence keeps its
tokens (recomputation re-runs them through the model, not through the matcher), so its matcher
is already at the right state when it runs again.

With a reasoning parser (`--reasoning-parser`), a sequence's grammar waits for the end of its
reasoning, as vLLM's does: the ids of the sequences still reasoning are in
`SequenceGroup.extra["reasoning"]`; their rows are not masked and their matchers do not advance
until they generate the parser's end tag (which the matcher never sees). A prompt that already
ended the reasoning (`ReasoningParser.is_reasoning_end`) starts the grammar at once.
"""

from __future__ import annotations

import logging

from pagedserve.structured_output.bitmask import GrammarBitmask
from pagedserve.structured_output.params import StructuredOutputsParams, xgrammar_message

logger = logging.getLogger(__name__)

GRAMMAR_KEY = "grammar"  # SequenceGroup.extra key: {seq_id: xgrammar.GrammarMatcher}
REASONING_KEY = "reasoning"  # SequenceGroup.extra key: {seq_id still reasoning}


class StructuredOutputManager:
    """Compiles constraints against the tokenizer (once per distinct constraint, cached) and keeps
    the per-sequence matchers' bookkeeping. The tokenizer's xgrammar info is built on the first
    constrained request (a 262k vocabulary takes a moment)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 disable_any_whitespace: bool = False, reasoner=None) -> None:
        self.tokenizer = tokenizer
        self.reasoner = reasoner  # reasoning.ReasoningParser, or None
        self.disable_any_whitespace = disable_any_whitespace
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._batch = None  # xgrammar.BatchGrammarMatcher, made on first use

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            # NOTE: vocab_size is the model's (its logits may have more rows than the tokenizer
            # has tokens): the ids past the tokenizer's are never allowed.
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        return self._compiler

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar of `so` (ValueError naming the problem when it cannot be)."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (the engine runs with "
                             "skip_tokenizer_init)")
        compiler = self._get_compiler()
        whitespace = not (so.disable_any_whitespace or self.disable_any_whitespace)
        try:
            if so.kind == "json":
                return compiler.compile_json_schema(so.schema_text(), any_whitespace=whitespace)
            if so.kind == "json_object":  # as vLLM: any JSON object
                return compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=whitespace)
            if so.kind == "regex":
                return compiler.compile_regex(so.regex)
            return compiler.compile_grammar(so.grammar_text())
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError
            raise ValueError(f"structured_outputs.{so.kind} cannot be compiled: "
                             f"{xgrammar_message(e)}") from None

    def new_matchers(self, so: StructuredOutputsParams, seq_ids: list[int]) -> dict:
        """A fresh matcher for each sequence of a request."""
        import xgrammar as xgr

        compiled = self.compile(so)
        return {seq_id: xgr.GrammarMatcher(compiled) for seq_id in seq_ids}

    def attach(self, group, so: StructuredOutputsParams, prompt_token_ids: list[int]) -> None:
        """Give every sequence of a new request its matcher (and, with a reasoning parser and a
        prompt that has not ended the reasoning, mark them as reasoning)."""
        seq_ids = [q.seq_id for q in group.seqs]
        group.extra[GRAMMAR_KEY] = self.new_matchers(so, seq_ids)
        if self.reasoner is not None and not self.reasoner.is_reasoning_end(prompt_token_ids):
            group.extra[REASONING_KEY] = set(seq_ids)

    def bitmask_for(self, sched) -> GrammarBitmask | None:
        """The token bitmask of every constrained sequence that samples this step (all of a
        forking group's sequences, from the row they share), or None when there is none. A
        speculative row of d drafts gets d + 1 consecutive masks (`GrammarBitmask.rows`): mask j
        is the grammar's after the drafts before j."""
        todo = []  # (seq id, matcher, drafts)
        for s in sched.scheduled:
            if not s.do_sample:
                continue
            matchers = s.group.extra.get(GRAMMAR_KEY)
            if not matchers:
                continue
            seqs = s.group.seqs[: s.num_samples] if s.num_samples > 1 else [s.seq]
            reasoning = s.group.extra.get(REASONING_KEY) or ()
            todo.extend((q.seq_id, matchers[q.seq_id], s.spec_token_ids) for q in seqs
                        if q.seq_id not in reasoning)
        if not todo:
            return None
        import xgrammar as xgr

        rows, n = {}, 0
        for seq_id, _, drafts in todo:
            rows[seq_id] = n
            n += 1 + len(drafts)
        bitmask = xgr.allocate_token_bitmask(n, self.vocab_size)
        if self._batch is None:
            # NOTE: one thread: filling 16 JSON-schema masks takes ~0.1 ms (xgrammar caches each
            # grammar state's mask); more threads only add their start-up and contend with the
            # step's own threads (measured: issue 17 in docs/benchmarks.md).
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        plain = [(seq_id, m) for seq_id, m, drafts in todo if not drafts]
        if len(plain) == len(todo):  # no speculative row: the masks fill in one batch
            self._batch.batch_fill_next_token_bitmask([m for _, m in plain], bitmask)
            return GrammarBitmask(bitmask, rows)
        for seq_id, matcher, drafts in todo:
            first = rows[seq_id]
            for j, token in enumerate(drafts):
                matcher.fill_next_token_bitmask(bitmask, first + j)
                # NOTE: the proposer kept only drafts the grammar allows (`valid_drafts`), and
                # tokens change only in the step update: every draft is accepted here.
                if not matcher.accept_token(token):
                    matcher.rollback(j)
                    raise RuntimeError(f"sequence {seq_id}: draft token {token} is outside its "
                                       "grammar (the proposer should have cut it)")
            matcher.fill_next_token_bitmask(bitmask, first + len(drafts))
            if drafts:
                matcher.rollback(len(drafts))
        return GrammarBitmask(bitmask, rows)

    def valid_drafts(self, group, seq, drafts: list[int]) -> list[int]:
        """Speculative decoding: the longest prefix of `drafts` that `seq`'s grammar allows (up
        to the first token it refuses; nothing after a token that ends it); all of them for an
        unconstrained request, none while `seq` reasons. Its matcher is left as it was."""
        matchers = group.extra.get(GRAMMAR_KEY)
        if not matchers or not drafts:
            return drafts
        reasoning = group.extra.get(REASONING_KEY)
        if reasoning and seq.seq_id in reasoning:
            return []
        matcher = matchers[seq.seq_id]
        n = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return drafts[:n]

    def accept(self, group, seq, token: int) -> bool | None:
        """Advance `seq`'s matcher with its new `token`. None when the request is unconstrained;
        else True when the grammar has ended (the sequence must stop), False to go on. While
        `seq` reasons, its matcher stays put; the token that ends the reasoning starts it.

        NOTE: a token the matcher rejects can only come from a row the grammar left nothing
        allowed in; the sequence stops there (logged) rather than continue outside its grammar.
        """
        matchers = group.extra.get(GRAMMAR_KEY)
        if not matchers:
            return None
        reasoning = group.extra.get(REASONING_KEY)
        if reasoning and seq.seq_id in reasoning:
            if self.reasoner.ends_reasoning(token, seq.token_ids):
                reasoning.discard(seq.seq_id)
            return False
        matcher = matchers[seq.seq_id]
        if not matcher.accept_token(token):
            logger.warning("request %s: token %d is outside its grammar; stopping the sequence",
                           group.request_id, token)
            return True
        return matcher.is_terminated()

    @staticmethod
    def fork(group, parent_id: int, child_id: int) -> None:
        """Give a forked sequence a copy of its parent's matcher (beam search)."""
        matchers = group.extra.get(GRAMMAR_KEY)
        if matchers:
            matchers[child_id] = matchers[parent_id].fork()
        reasoning = group.extra.get(REASONING_KEY)
        if reasoning and parent_id in reasoning:
            reasoning.add(child_id)
