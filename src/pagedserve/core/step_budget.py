"""How many tokens a step computes, and which of them a request takes: the scheduler's two
budget rules, as functions of its config and the request's state. Pure Python, no torch.

- `step_budget`: the step's token budget (`max_num_batched_tokens`, or one that grows with the
  step's decode rows: `prompt_budget_per_decode_row`).
- `plan_tokens`: the (sequence, start, end) ranges a request's sequences compute within what is
  left of the budget (chunked prefill, `long_prefill_token_threshold`, draft tokens).
"""

from __future__ import annotations

from pagedserve.core.sched_types import Plan, SchedulerConfig
from pagedserve.sequence import SequenceGroup


def step_budget(config: SchedulerConfig, decode_rows: int, next_prompt: SequenceGroup | None) -> int:
    """The step's token budget: max_num_batched_tokens, or with `prompt_budget_per_decode_row`
    (r) and chunked prefill, min(max_num_batched_tokens, decode_rows + max(r * decode_rows,
    24 * r, the next prompt's remaining tokens)): every step has room for prompt tokens.
    `next_prompt`: the first request in queue order still computing its prompt (running, else
    waiting), or None.

    NOTE: why. Every request whose prompt ends in a step gets its first token when the step
    ends. In a burst of short prompts a 2,048-token step ends a dozen of them together, and
    the first ones wait for the last; smaller steps hand them out sooner (a burst of 16
    prompts of 160 tokens: TTFT p50 ~0.75x, docs/benchmarks.md). A step also pays for its
    decode rows (the LM head, attention, the weights read once a step), so the budget grows
    with them, to the full one at 64 rows (r = 32). A step is never smaller than the next
    prompt: splitting one long prompt finer would only add steps.
    """
    cap = config.max_num_batched_tokens
    per_row = config.prompt_budget_per_decode_row
    if not per_row or not config.enable_chunked_prefill:
        return cap
    prompt = max(per_row * decode_rows, 24 * per_row)
    if decode_rows + prompt >= cap:
        return cap
    if next_prompt is not None:
        seq = next_prompt.seqs[0]
        prompt = max(prompt, seq.num_tokens - seq.num_computed_tokens)
    return min(cap, decode_rows + prompt)


def plan_tokens(config: SchedulerConfig, group: SequenceGroup, budget: int,
                align: int = 0) -> Plan | None:
    """(seq, start, end) for the group's sequences that can compute within `budget`, or None
    if none can. `align` (a block size; 0: none): a prompt chunk that would run past the
    sequence's `snapshot_at` or its prompt's last full block ends there (a recurrent state's
    snapshot is taken at a step's start: core/state_snapshots.py), with chunked prefill.

    NOTE: a group need not compute all its sequences in one step: after a recomputation each
    sequence recomputes its own output, and together they may exceed any token budget. Every
    sequence stays resident (blocks are all-or-nothing per group); the ones left out this
    step are taken in later steps.
    """
    chunked = config.enable_chunked_prefill
    plan: Plan = []
    seqs = group.unfinished_seqs()
    if group.fork_pending:
        seqs = seqs[:1]
    for seq in seqs:
        if budget <= 0:
            break
        if seq.parked:  # its turn has not come (see Turns._unpark)
            continue
        start = seq.num_computed_tokens
        # A group that will fork computes the parent's prompt alone, then the others share it.
        stop = seq.num_prompt_tokens if group.fork_pending else seq.num_tokens
        want = stop - start
        if want <= 0:  # a beam waiting for its siblings' candidates: nothing to compute
            continue
        if (want == 1 and seq.spec_token_ids and not group.fork_pending
                and start >= seq.num_prompt_tokens):
            # A decode row with draft tokens (speculative decoding): 1 + d tokens, as many
            # drafts as the budget allows. NOTE: never on a prompt's last token (its row may
            # want prompt logprobs), nor on a forking parent's (its siblings' first token).
            take = min(1 + len(seq.spec_token_ids), budget)
        else:
            take = min(want, budget) if chunked else want
            cap = config.long_prefill_token_threshold
            if chunked and cap and start < seq.num_prompt_tokens:  # a prompt's chunk
                take = min(take, cap)
            if align and chunked and start < seq.num_prompt_tokens:
                # (a later prompt's hit leaves its last token to compute: this is the last
                # boundary it can start from; never the first block's, the live state's row;
                # and first the junction with an earlier prompt, `Sequence.snapshot_at`)
                for boundary in (seq.snapshot_at, (seq.num_prompt_tokens - 1) // align * align):
                    if start < boundary < start + take and boundary >= 2 * align:
                        take = boundary - start
                        break
        if take > budget:  # without chunking a sequence computes whole: a later step
            continue
        plan.append((seq, start, start + take))
        budget -= take
    return plan or None
