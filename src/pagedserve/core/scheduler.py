"""Iteration-level scheduler (FCFS or by priority) with all-or-nothing preemption. Pure Python,
no torch.

Every step `schedule()` picks the tokens to compute: decode tokens, then prompt (or
recomputation) chunks of the running requests in queue order, allocating blocks as they fill;
then swapped requests coming back; then, when nothing was preempted, nothing is swapped out and no
running request has sequences waiting their turn, new requests from the waiting queue in order,
as long as their tokens fit the step's budget and their blocks fit the free pool. Queue order is
arrival (`scheduling_policy="fcfs"`) or (priority, arrival) ("priority": lower values first).
When a running request needs a block and none is free, the last request in queue order (the most
recently arrived; under "priority" the lowest priority) is preempted whole (all its sequences):
its blocks are swapped to the CPU pool (`preemption_mode` "swap", or "auto" when cheaper) or
freed, and it goes back to the waiting queue to be recomputed.

Turns (see README "Preemption"): a request alone in the cache whose sequences cannot all hold
their blocks at once gives up all-or-nothing residency: its last sequences give their blocks back
("parked": they are recomputed later, exactly, from their tokens) so that the first ones grow;
a parked sequence comes back, its prompt's full blocks shared with a resident sibling (or found
in the prefix cache), when the blocks for its tokens are free with one to spare per resident
sibling, or at once when no sibling of it needs to compute.

Each step's output carries its `StepDelta` (core/step_delta.py): what the workers' mirrors must
change (new requests and sequences, new tokens, changed block-table entries, freed sequences and
finished requests), read from the marks the core sets as it changes things, nothing compared.

After the model ran, `update_from_output` applies the step: computed tokens, prefix-cache
registration, forks, appended tokens, token-level stops (EOS, stop token ids, lengths), beam
steps, finishes and frees. The engine plugs text-level work (detokenizing, stop strings, logprob
formatting) in through a `StepObserver`.

Progress guarantee: the first running request in queue order is never a victim unless it is
alone, and a request alone runs its sequences in turns, the first of which always fits (the
engine admits a request only if one of its sequences alone fits the whole pool); a group may
compute any subset of its sequences in a step, so a group being recomputed always fits the token
budget; a swapped group that could not come back even into an empty cache is recomputed instead.
Requests that can never be admitted are rejected by the engine (`LLMEngine.add_request`) before
they are queued.

NOTE (step cost): every queue is a `GroupQueue` (O(1) membership by request id); a step touches
each running group a constant number of times, and the step update only the scheduled ones; the
rows of victims unscheduled in a step leave its output in one pass (`StepPlan.finish`).
"""

from __future__ import annotations

import itertools
from typing import Callable

from pagedserve.core.admission import Admission
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.preemption import Preemption
from pagedserve.core.queues import GroupQueue, arrival_key, priority_key, queued_key
from pagedserve.core.sched_types import (  # noqa: F401 (re-exported)
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    Plan,
    ScheduledSequence,
    SchedulerConfig,
    SchedulerOutput,
    StepPlan,
)
from pagedserve.core.spec_decode import drop_lookahead
from pagedserve.core.step_budget import plan_tokens, step_budget
from pagedserve.core.step_delta import StepDelta, take_delta
from pagedserve.core.step_update import StepObserver, StepUpdate, apply_step
from pagedserve.core.turns import Turns
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


class Scheduler(Admission, Turns, Preemption):
    """Continuous-batching scheduler over a `KVCacheManager`; see the module docstring.

    Queues, each in queue order (arrival, or (priority, arrival)): `waiting` (new, and preempted
    by recomputation), `running`, `swapped` (preempted by swapping). `new_seq_id` hands out ids
    for the sequences beam search forks. `num_turns` counts sequences parked to let their
    siblings grow (see the module docstring).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 new_seq_id: Callable[[], int] | None = None) -> None:
        self.config = config
        self.kv = kv
        # NOTE: under fcfs the waiting queue keeps the order requests were queued in (a group
        # requeued for recomputation goes back to its place, ahead of every later one); the
        # running and swapped queues are in arrival order. Under priority all three are in
        # (priority, arrival) order.
        if config.scheduling_policy == "priority":
            self.waiting = GroupQueue(priority_key)
            self.running = GroupQueue(priority_key)
            self.swapped = GroupQueue(priority_key)
        else:
            self.waiting = GroupQueue(queued_key)
            self.running = GroupQueue(arrival_key)
            self.swapped = GroupQueue(arrival_key)
        self._num_queued = 0
        self._finished_ids: list[str] = []
        self._freed_seq_ids: list[int] = []
        # The next step's delta for the workers (core/step_delta.py): its freed sequences and
        # finished requests gather here; `schedule` adds the rows' changes.
        self._delta = StepDelta()
        self.num_preemptions = 0
        self.preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.num_turns = 0
        self.num_undone_victims = 0  # victims taken back out of the step that scheduled them
        self.new_seq_id = new_seq_id or itertools.count((1 << 40) + 1).__next__
        self._snapshots, self._align = False, 0  # (set by each `schedule`)

    # --- queue management --------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request. Raises ValueError for a group that could never be admitted."""
        if group.max_width > self.config.max_num_seqs:
            raise ValueError(
                f"n/best_of/beam width {group.max_width} is more than max_num_seqs "
                f"({self.config.max_num_seqs}): the request could never be scheduled")
        if group.priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority={group.priority}: priorities need "
                             "--scheduling-policy priority (scheduling_policy='priority'); the "
                             "engine schedules fcfs")
        self._num_queued += 1
        group.queue_no = self._num_queued
        self.waiting.add(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request wherever it is, free its blocks, mark its sequences aborted."""
        for queue in (self.running, self.waiting, self.swapped):
            group = queue.get(request_id)
            if group is not None:
                queue.remove(group)
                for seq in group.seqs:
                    if not seq.is_finished:
                        seq.status = SequenceStatus.FINISHED_ABORTED
                self._release(group)
                return group
        return None

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """End one sequence and free its blocks; the group leaves `running` when all are done."""
        seq.status = status
        self.kv.free(seq.seq_id)

    def remove_finished(self, candidates=None) -> list[SequenceGroup]:
        """Drop groups whose sequences all finished from `running`; return them. `candidates`:
        the only groups that may have finished (the step's), else every running group."""
        pool = self.running if candidates is None else candidates
        done = [g for g in pool if g.is_finished and g in self.running]
        if done:
            self.running.remove_many(done)
            for group in done:
                self._release(group)
        return done

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.max_width_left for g in self.running)

    def _release(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.kv.free(seq.seq_id)
        self._finished_ids.append(group.request_id)
        if group.sent:  # the workers hold it
            self._delta.finished_requests.append(group.request_id)

    def check_invariants(self) -> None:
        """Raise RuntimeError unless the queues and the block tables agree: the KV manager's own
        checks, a request in one queue only, every unfinished sequence of a running group on the
        device (of a swapped group in the CPU pool, of a waiting group nowhere), finished
        sequences holding no blocks, and at most `max_num_seqs` running sequences."""
        self.kv.check_invariants()
        seen: set[str] = set()
        for queue, place in ((self.running, "device"), (self.swapped, "cpu"), (self.waiting, "")):
            for group in queue:
                if group.request_id in seen:
                    raise RuntimeError(f"request {group.request_id} is in two queues")
                seen.add(group.request_id)
                live = group.unfinished_seqs()
                if place == "" and any(q.parked for q in live):
                    raise RuntimeError(f"waiting request {group.request_id} has parked sequences")
                for seq in group.seqs:
                    held = (seq.seq_id in self.kv.tables, seq.seq_id in self.kv.cpu_tables)
                    # A forking group's other sequences hold nothing until the fork; a parked
                    # sequence holds nothing until its turn.
                    holds = not (seq.is_finished or seq.parked
                                 or (group.fork_pending and seq is not live[0]))
                    expected = (holds and place == "device", holds and place == "cpu")
                    if held != expected:
                        raise RuntimeError(
                            f"request {group.request_id} ({place or 'waiting'}): sequence "
                            f"{seq.seq_id} holds device/cpu blocks {held}, expected {expected}")
        if self.num_running_seqs > self.config.max_num_seqs:
            raise RuntimeError(f"{self.num_running_seqs} running sequences > max_num_seqs")

    # --- the interface of the step update (core.step_update.StepTarget) ------------------------

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    @property
    def prefix_caching(self) -> bool:
        return self.kv.enable_prefix_caching

    @property
    def sliding_window(self) -> bool:
        return self.kv.has_sliding_window

    def truncate(self, seq: Sequence, start: int = 0, all_accepted: bool = True) -> None:
        """Give back the slots past `seq.num_computed_tokens` (a speculative row's rejected
        drafts: whole blocks freed, `KVCacheManager.truncate`). A state model's row that started
        at `start` and had a draft rejected rolls its state back (core/state_rollback.py): the
        sequence has then computed `start` tokens, and the next step computes the rest again."""
        kv = self.kv
        if kv.has_state_backup(seq.seq_id) and not kv.settle_state(seq.seq_id, all_accepted):
            seq.num_computed_tokens = start
        kv.truncate(seq.seq_id, seq.num_computed_tokens)

    def free_out_of_window(self, seq: Sequence) -> None:
        """Give back the blocks no query of the sequence reaches any more (sliding windows)."""
        self.kv.free_out_of_window(seq.seq_id, seq.num_computed_tokens)

    # --- after the step ----------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, results: list,
                           observer: StepObserver | None = None) -> StepUpdate:
        """Apply a step's results (one `SeqStepOutput` per scheduled sequence, in order): see
        `core.step_update.apply_step`."""
        return apply_step(self, sched, results, observer)

    def end_step(self) -> None:
        """The step has run: the state snapshots it copied stay cached, unpinned."""
        self.kv.end_step()

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer a sequence's newly computed full blocks to the prefix cache."""
        self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                                  seq.cache_salt)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks (shared, copy-on-write) and computed tokens (a parked
        parent's child is parked too)."""
        child.status = parent.status
        if parent.parked:
            child.parked, child.num_computed_tokens = True, 0
            return
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens

    def drop_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """Remove a pruned beam from its group and free its blocks (a parked one holds none)."""
        self.kv.free(seq.seq_id)
        group.seqs.remove(seq)
        self._freed_seq_ids.append(seq.seq_id)
        if seq.sent_tokens >= 0:  # the workers hold it
            self._delta.freed_seqs.append(seq.seq_id)

    def fork_if_ready(self, group: SequenceGroup) -> list[Sequence]:
        """Once the parent of a forking group has computed its prompt, give the other sequences
        its blocks (shared, copy-on-write) and its computed prompt. Returns the sequences, parent
        first, or [] if the group is not forking now."""
        seqs = group.unfinished_seqs()
        if not group.fork_pending or seqs[0].num_computed_tokens < seqs[0].num_prompt_tokens:
            return []
        parent = seqs[0]
        for child in seqs[1:]:
            self.fork(parent, child)
        group.fork_pending = False
        return seqs

    # --- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens; allocate their blocks; preempt when the pool runs dry.

        Order: decode tokens of running requests first (so that a long prompt never stalls every
        stream), then prompt chunks of running requests, then swapped requests coming back, then
        new requests (only when nothing is swapped out, nothing was preempted this step and no
        running request has sequences waiting their turn).
        """
        self.kv.end_step()  # (the last step has run: what it copied is unpinned)
        # A recurrent state model with prefix caching: snapshots of its state, and prompt chunks
        # that end at the prompt's last full block (core/state_snapshots.py).
        self._snapshots = self.kv.snapshots_state
        self._align = self.kv.block_size if self._snapshots else 0
        out = SchedulerOutput(finished_request_ids=self._finished_ids,
                              freed_seq_ids=self._freed_seq_ids)
        self._finished_ids, self._freed_seq_ids = [], []
        delta, self._delta = self._delta, StepDelta()
        decoding, prefilling = [], []
        is_decoding = self._is_decoding
        for g in self.running:
            seqs = g.seqs
            if len(seqs) == 1:  # (_is_decoding's common case, inlined: once per group)
                s = seqs[0]
                (decoding if s.is_finished or len(s.token_ids) - s.num_computed_tokens == 1
                 else prefilling).append(g)
            else:
                (decoding if is_decoding(g) else prefilling).append(g)
        nxt = prefilling[0] if prefilling else self.waiting[0] if self.waiting else None
        step = StepPlan(step_budget(self.config, len(decoding), nxt))
        decoding.extend(prefilling)
        running = self.running
        for group in decoding:
            if step.budget <= 0:
                break
            # Only a preemption or a length cap takes a group out of `running` in this loop.
            if (out.preempted or out.length_capped) and group not in running:
                continue
            seqs = group.seqs
            if len(seqs) == 1 and self._decode_one(group, seqs[0], step, out):
                continue
            self._schedule_running(group, step, out)

        # Kept up to date below, not recounted per request (nor counted when nothing waits).
        slots = self.num_running_seqs if self.swapped or self.waiting else 0
        while self.swapped and not out.preempted and step.budget > 0:
            group = self.swapped[0]
            seq_ids = [s.seq_id for s in group.unfinished_seqs() if not s.parked]
            plan = plan_tokens(self.config, group, step.budget, self._align)
            # NOTE: beams that all wait for the candidates of a sibling parked by turns plan
            # nothing, yet the group must come back: it returns without tokens, and the parked
            # sibling's turn comes in its next step (`_schedule_running`). Waiting for a plan
            # here left it swapped out for good (a hang).
            idle_return = plan is None and any(
                q.parked and q.beam_candidates is None for q in group.unfinished_seqs())
            returns = plan is not None or idle_return
            need = self._blocks_to_swap_in(group, plan or []) if returns else 0
            if returns and need > self.kv.num_blocks:
                # It could not come back even into an empty cache: recompute it instead.
                self.swapped.popleft()
                self._requeue_for_recompute(group)
                continue
            if (not returns or need > self.kv.num_free_blocks
                    or slots + group.max_width_left > self.config.max_num_seqs
                    or self._lora_blocked(group)):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.kv.swap_in(seq_ids))
            self._set_running(group)
            slots += group.max_width_left
            if plan is not None:
                self._commit(plan, group, step, out)

        skipped = 0  # waiting groups passed over this step: their adapter has no slot (vLLM's)
        while (len(self.waiting) > skipped and not self.swapped and not out.preempted
               and step.budget > 0):
            group = self.waiting[skipped]
            if slots + group.max_width_left > self.config.max_num_seqs:
                break
            if self._lora_blocked(group):
                # NOTE: as vLLM's scheduler, the requests behind it (the base model, adapters
                # already running) go on; it keeps its place and runs once a slot frees up.
                skipped += 1
                continue
            # NOTE: a request whose sequences take turns gets the blocks they free, before any
            # new request (under "priority", before any new request of its priority or lower).
            if step.turns_key is not None and (self.config.scheduling_policy != "priority"
                                               or self.waiting.key(group) >= step.turns_key):
                break
            admitted = self._plan_admission(group, step.budget)
            if admitted is None:
                break
            plan, hits = admitted
            for seq, blocks in hits:
                self.kv.prefix_hits += self.kv.use_prefix(seq.seq_id, blocks)
            if group.num_cached_tokens is None:  # usage's cached_tokens: the first admission's
                group.num_cached_tokens = max((self.kv.hit_tokens(b) for _, b in hits),
                                              default=0)
            if self.kv.enable_prefix_caching:
                self.kv.prefix_queries += sum(self._lookup_len(group, seq) for seq, _, _ in plan)
            self.waiting.pop(skipped)
            self._set_running(group)
            slots += group.max_width_left
            self._commit(plan, group, step, out)
        out = step.finish(out)
        if self._snapshots:  # states of prefix hits, then snapshots from the blocks left free
            out.blocks_to_copy.extend(self.kv.take_hit_copies())
            out.blocks_to_copy.extend(self.kv.take_snapshots(
                [(s.seq.seq_id, s.seq.token_ids, s.start, s.seq.cache_salt)
                 for s in out.scheduled], out.blocks_to_copy))
        out.delta = take_delta(out.scheduled, self.kv, delta)
        return out

    def _lora_blocked(self, group: SequenceGroup) -> bool:
        """Whether `group`'s adapter would be one more than `max_loras` distinct adapters among
        the running requests (the workers' slot table holds that many: it waits its turn)."""
        lora = group.lora_request
        if lora is None or not self.config.max_loras:
            return False
        running = {g.lora_request.lora_int_id for g in self.running if g.lora_request is not None}
        return lora.lora_int_id not in running and len(running) >= self.config.max_loras

    def _schedule_running(self, group: SequenceGroup, step: StepPlan,
                          out: SchedulerOutput) -> None:
        parked = group.parked_seqs()
        if parked:
            self._unpark(group, parked)
        plan = plan_tokens(self.config, group, step.budget, self._align)
        if plan is None and parked:
            # No resident sibling computes (beams holding their candidates, or none left): the
            # first parked sequence that needs to compute comes back now, making room for
            # itself below if need be.
            due = [q for q in parked if q.parked and q.beam_candidates is None]
            if due:
                self._unpark_one(group, due[0])
                plan = plan_tokens(self.config, group, step.budget, self._align)
        if parked:
            step.note_turns(self.running.key(group))
        if plan is None:
            return
        while not self._fits(plan):
            if any(end > seq.num_tokens for seq, _, end in plan):
                # Draft tokens' lookahead slots never cost anybody their blocks: drop them first.
                plan = drop_lookahead(plan)
                continue
            victim = self.running[-1]
            if victim is group and len(self.running) == 1:
                # Alone in the cache: the group's sequences take turns.
                seq = self._turn_victim(group, plan)
                if seq is None:
                    # One sequence alone, short of blocks. NOTE: a request the engine admitted
                    # fits the pool alone, but a state model's sequence started from a snapshot
                    # in this step also holds the snapshot (pinned until the step's copy has
                    # run): it computes what fits now, or waits for the next step; it was cut
                    # short (finish_reason "length") before.
                    trimmed = self._trim_to_fit(plan[0])
                    if trimmed is not None:
                        plan = [trimmed]
                        continue
                    if self.kv.holds_pinned_snapshots:
                        return
                    # Unreachable otherwise (one sequence always fits the pool); a last resort.
                    self.running.pop()
                    for q in group.unfinished_seqs():
                        self.finish_seq(q, SequenceStatus.FINISHED_LENGTH)
                    self._release(group)
                    out.length_capped.append(group)
                    return
                self._park(group, seq)
                step.note_turns(self.running.key(group))  # what it freed is its siblings' turn
                plan = [p for p in plan if p[0] is not seq]
                continue
            self.running.pop()
            self.num_undone_victims += step.unschedule(victim, out, self.kv)
            self._preempt(victim, out)
            if victim is group:
                return
        self._commit(plan, group, step, out)

    def _decode_one(self, group: SequenceGroup, seq: Sequence, step: StepPlan,
                    out: SchedulerOutput) -> bool:
        """Schedule the decode token of a group's one sequence, if that is all there is to it (a
        running, unparked sequence past its prompt with one token to compute and no drafts)
        and its blocks fit: what `_schedule_running` then does, without building a plan.
        Returns False, having changed nothing, in every other case (the general path decides).

        NOTE (step cost): the common row of a large batch; `tests/core/test_scheduler.py` pins
        that both paths schedule the same rows.
        """
        start = seq.num_computed_tokens
        end = start + 1
        if (seq.is_finished or len(seq.token_ids) != end or seq.spec_token_ids or seq.parked
                or start < seq.num_prompt_tokens or group.fork_pending):
            return False
        kv = self.kv
        seq_id = seq.seq_id
        need = kv.num_new_blocks(seq_id, end)  # (0 but once every block_size tokens)
        if need and need > kv.num_free_blocks:
            return False  # a preemption (or turns) decides
        snapshot = kv.snapshot(seq_id)
        copies = kv.allocate_slots(seq_id, end)
        if copies:
            out.blocks_to_copy.extend(copies)
        # (ScheduledSequence.make for this case: it samples, one token, no prompt logprobs)
        entry = ScheduledSequence(group, seq, start, end, kv.tables[seq_id].blocks, True, False,
                                  1)
        out.scheduled.append(entry)
        step.record_one(group, seq_id, snapshot, entry, copies)
        return True

    def _blocks_to_swap_in(self, group: SequenceGroup, plan: Plan) -> int:
        """Device blocks a swapped group needs to come back and run `plan`: the distinct CPU
        blocks of all its sequences, the blocks its planned tokens fill, and one copy-on-write
        block per planned sequence (an upper bound)."""
        seq_ids = [seq.seq_id for seq in group.unfinished_seqs()]
        grow = sum(self.kv.num_swap_in_growth(seq.seq_id, end) for seq, _, end in plan)
        return self.kv.num_distinct_blocks(seq_ids, cpu=True) + grow

    @staticmethod
    def _is_decoding(group: SequenceGroup) -> bool:
        """Every unfinished sequence has one real token left to compute (its row may still carry
        draft tokens after it: 1 .. k + 1 tokens, see `step_budget.plan_tokens`)."""
        seqs = group.seqs
        if len(seqs) == 1:  # the common case, without a loop
            s = seqs[0]
            return s.is_finished or len(s.token_ids) - s.num_computed_tokens == 1
        for s in seqs:
            if not s.is_finished and len(s.token_ids) - s.num_computed_tokens != 1:
                return False
        return True

    def _set_running(self, group: SequenceGroup) -> None:
        for seq in group.unfinished_seqs():
            seq.status = SequenceStatus.RUNNING
        # NOTE: `running` stays in queue order: the victim of a preemption is its last entry.
        self.running.add(group)

    def _fits(self, plan: Plan) -> bool:
        kv = self.kv
        # (a row past its sequence's tokens carries drafts: a state model keeps its state)
        if len(plan) == 1:  # the common case, without a loop
            seq, _, end = plan[0]
            return kv.num_new_blocks(seq.seq_id, end, end > seq.num_tokens) <= kv.num_free_blocks
        need = 0
        for seq, _, end in plan:
            need += kv.num_new_blocks(seq.seq_id, end, end > seq.num_tokens)
        return need <= kv.num_free_blocks

    def _commit(self, plan: Plan, group: SequenceGroup, step: StepPlan,
                out: SchedulerOutput) -> None:
        record = step.record_for(group)
        kv = self.kv
        tables = kv.tables
        scheduled = out.scheduled
        make = ScheduledSequence.make
        tokens = 0
        for seq, start, end in plan:
            seq_id = seq.seq_id
            record.snapshots.append((seq_id, kv.snapshot(seq_id)))
            copies = kv.allocate_slots(seq_id, end, end > seq.num_tokens)
            if copies:
                out.blocks_to_copy.extend(copies)
                record.copies.extend(copies)
            entry = make(group, seq, start, end, tables[seq_id].blocks)
            scheduled.append(entry)
            record.entries.append(entry)
            tokens += end - start
        record.tokens += tokens
        step.budget -= tokens
