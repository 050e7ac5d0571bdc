"""The engine core: the scheduler and the model executor, without text, in its own process.

`EngineCore` is an `LLMEngine` that takes token ids and returns token ids: it keeps the tokenizer
only for what the step itself needs (structured outputs' grammars, the reasoning parser's think
tags) and never detokenizes. Its step returns one `RequestDelta` per request that advanced: the
new tokens of each sequence, their raw logprobs, finish reasons, timings. Stop strings are the
front end's (`engine/output_processor.py`); when one matches, the front end stops the sequence
(`CoreStopSeqs`) or aborts the request, and drops what the core computed past it.

`run_core` is a core process's loop (vLLM v1's EngineCoreProc): commands arrive on a zmq PULL
socket (msgspec frames, `engine/core_messages.py`), are applied between steps (so every request
that arrived during a step joins the next one), the engine steps while anything is in flight and
blocks on the socket when idle, and every step's deltas, stats and KV events go back on a zmq
PUSH socket. `CoreActor` runs the same loop inside a Ray actor (`--data-parallel-backend ray`).

A step that raises fails only the requests it scheduled (`failed`; their blocks freed), as the
in-process async engine does; a dead model worker, or a failure that cannot be pinned on any
request twice in a row, ends the process: the front end sees the core die.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
from typing import Any

from pagedserve.config import EngineArgs
from pagedserve.engine.core_messages import (
    BeamHyp,
    CoreAbort,
    CoreOutputs,
    CoreReady,
    CoreRequest,
    CoreShutdown,
    CoreStats,
    CoreStopSeqs,
    CoreUtility,
    RequestDelta,
    SeqDelta,
    decode_input,
    encode,
)
from pagedserve.engine.kv_events import KVEventCollector, KVEventsConfig, make_publisher
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sequence import SequenceGroup

logger = logging.getLogger(__name__)

# The calls a front end may make by name (CoreUtility); nothing else is ever run.
UTILITY_METHODS = ("check_invariants", "reset_prefix_cache", "add_lora", "remove_lora",
                   "list_loras", "engine_state", "ping")


class _Sent:
    """What the front end has already been sent of one sequence (`Sequence.handed_tokens`,
    opaque to the scheduler)."""

    __slots__ = ("tokens", "logprobs", "sample_lps", "finished")

    def __init__(self) -> None:
        self.tokens = 0  # output tokens sent
        self.logprobs = 0  # raw logprob entries sent
        self.sample_lps: list[float | None] = []  # per output token not yet sent
        self.finished = False


class EngineCore(LLMEngine):
    """An `LLMEngine` without text (see the module docstring): `add_core_request` takes a
    `CoreRequest`, `step()` returns `RequestDelta`s."""

    def __init__(self, args: EngineArgs, engine_index: int = 0,
                 kv_events: KVEventsConfig | None = None) -> None:
        super().__init__(args)
        self.engine_index = engine_index
        # NOTE: no text in the core: sequences get no detokenizer, logprob entries stay raw and
        # stop strings are refused here (the front end strips them before sending). The
        # structured-output manager and the reasoning parser keep their own tokenizer.
        self.text_tokenizer = self.tokenizer
        self.tokenizer = None
        self._stop_seqs: set[tuple[str, int]] = set()
        self._lora_names: dict[int, str] = {}
        self.kv_events = KVEventCollector(args.block_size, engine_index, self._lora_names)
        self._publisher = make_publisher(kv_events, engine_index)
        self.kv_manager.events = self.kv_events

    def _build_cache(self, args: EngineArgs) -> None:
        super()._build_cache(args)
        events = getattr(self, "kv_events", None)
        if events is not None:  # a rebuilt cache (reconfigure_cache): events continue
            self.kv_manager.events = events

    # --- requests ------------------------------------------------------------------------------

    def add_core_request(self, req: CoreRequest) -> None:
        """Validate and queue a front end's request (ValueError as `add_request`)."""
        params = req.pooling_params if req.pooling_params is not None else req.sampling_params
        if params is None:
            raise ValueError("sampling_params: a request needs sampling or pooling parameters")
        if req.lora_request is not None:
            self._lora_names[req.lora_request.lora_int_id] = req.lora_request.lora_name
        if req.validate_only:  # the front end checked the prompt's ids: its length counts here
            self.check_priority(req.priority)
            if req.pooling_params is None:
                self._validate_params(params, len(req.prompt_token_ids))
            else:
                self._validate_pooling(len(req.prompt_token_ids))
            self.lora.check(req.lora_request)
            return
        group = self.add_request(req.request_id, None, params,
                                 prompt_token_ids=req.prompt_token_ids,
                                 arrival_time=req.arrival_time or None, priority=req.priority,
                                 lora_request=req.lora_request)
        for seq in group.seqs:
            seq.handed_tokens = _Sent()

    def abort_request(self, request_id: str) -> bool:
        self._stop_seqs = {k for k in self._stop_seqs if k[0] != request_id} \
            if self._stop_seqs else self._stop_seqs
        return super().abort_request(request_id)

    def stop_seqs(self, seqs) -> None:
        """The front end matched a stop string in these (request id, index) sequences: each
        ends at its next token here."""
        for request_id, index in seqs:
            if request_id in self.groups:
                self._stop_seqs.add((request_id, index))

    # --- the scheduler's StepObserver, without text ----------------------------------------------

    def on_prompt_logprobs(self, s, r) -> None:
        group = s.group
        ids = s.seq.token_ids
        for offset, (lp, rank, top) in enumerate(r.prompt_logprobs):
            group.prompt_logprobs.append((ids[s.start + 1 + offset], lp, rank, top))

    def on_token(self, group: SequenceGroup, seq, res, check_stop: bool, stops: bool) -> bool:
        sent = seq.handed_tokens
        if res.top_logprobs is not None:
            seq.output_logprobs.append((res.token_id, res.logprob, res.rank, res.top_logprobs))
        if sent is not None:
            sent.sample_lps.append(res.logprob)
        token = res.token_id
        if group.extra and self.structured.accept(group, seq, token):
            return True
        stop = self._stop_seqs
        if stop and (group.request_id, seq.index) in stop:
            stop.discard((group.request_id, seq.index))
            return True
        return False

    # --- outputs -----------------------------------------------------------------------------------

    def _make_output(self, group: SequenceGroup, finished: bool) -> RequestDelta:
        """The request's progress since the last delta (replaces `LLMEngine`'s RequestOutput)."""
        delta = RequestDelta(
            request_id=group.request_id, finished=finished,
            num_cached_tokens=group.num_cached_tokens, num_preemptions=group.num_preemptions,
            first_scheduled_time=group.first_scheduled_time,
            first_token_time=group.first_token_time, finished_time=group.finished_time)
        if group.pooling is not None:
            if group.pooled is not None:
                data = group.pooled.contiguous()
                delta.pooled = (data.numpy().tobytes(), list(data.shape), str(data.dtype))
            return delta
        if group.beam is not None:
            out = super()._make_beam_output(group, finished)
            delta.beams = [BeamHyp(list(c.token_ids), c.cumulative_logprob, c.finish_reason)
                           for c in out.outputs]
            return delta
        plp = group.prompt_logprobs
        if plp is not None:
            sent = group.extra.get("_plp_sent", 0)
            if len(plp) > sent:
                delta.prompt_logprobs = list(plp[sent:])
                group.extra["_plp_sent"] = len(plp)
        want_lp = group.needs_logprobs
        seqs = []
        for seq in group.seqs:
            sent = seq.handed_tokens
            if sent is None:  # a sequence forked in the core (best_of / n share a prompt)
                sent = seq.handed_tokens = _Sent()
            if sent.finished:
                continue
            start = seq.num_prompt_tokens + sent.tokens
            new = seq.token_ids[start:]
            d = SeqDelta(seq.index, new)
            if want_lp:
                d.sample_logprobs = sent.sample_lps
                sent.sample_lps = []
            else:
                sent.sample_lps.clear()
            if seq.output_logprobs and len(seq.output_logprobs) > sent.logprobs:
                d.logprobs = seq.output_logprobs[sent.logprobs:]
                sent.logprobs = len(seq.output_logprobs)
            sent.tokens += len(new)
            if seq.is_finished:
                sent.finished = True
                d.finish_reason = seq.status.finish_reason
                d.stop_reason = seq.stop_reason
            if new or d.finish_reason is not None:
                seqs.append(d)
        delta.seqs = seqs
        return delta

    # --- state for the front end -----------------------------------------------------------------

    def load_tokens(self) -> int:
        """Queued plus running tokens: every unfinished request's context (prompt and output so
        far), the routing load."""
        total = 0
        for group in self.groups.values():
            for seq in group.seqs:
                if not seq.is_finished:
                    total += len(seq.token_ids)
        return total

    def core_stats(self) -> CoreStats:
        s, kv, sched = self.stats, self.kv_manager, self.scheduler
        cpu = kv.cpu_pool
        return CoreStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped), kv_usage=kv.usage(), num_used_blocks=kv.pool.num_used,
            num_blocks=kv.num_blocks, cpu_kv_usage=cpu.num_used / cpu.num_blocks if cpu else 0.0,
            steps=s["steps"], prompt_tokens=s["prompt_tokens"],
            generation_tokens=s["generation_tokens"], preemptions=sched.num_preemptions,
            prefix_queries=getattr(kv, "prefix_queries", 0),
            prefix_hits=getattr(kv, "prefix_hits", 0), load_tokens=self.load_tokens(),
            preemptions_by_mode=dict(sched.preemptions_by_mode))

    def ready_info(self) -> CoreReady:
        return CoreReady(
            engine_index=self.engine_index, max_model_len=self.max_model_len,
            vocab_size=self.vocab_size, num_kv_blocks=self.num_kv_blocks,
            block_size=self.args.block_size, num_cpu_blocks=self.num_cpu_blocks,
            eos_token_ids=list(self.eos_token_ids), runner=self.runner, pid=os.getpid(),
            node=socket.gethostname())

    def utility(self, method: str, args: list[Any]) -> Any:
        """One of `UTILITY_METHODS` (ValueError for any other name)."""
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown engine core call {method!r}")
        if method == "ping":
            return True
        if method == "check_invariants":
            self.check_invariants()
            return True
        if method == "reset_prefix_cache":
            return self.kv_manager.reset_prefix_cache()
        if method == "add_lora":
            from pagedserve.lora.request import LoRARequest

            request = LoRARequest(*args)
            self._lora_names[request.lora_int_id] = request.lora_name
            return self.add_lora(request)
        if method == "remove_lora":
            return self.remove_lora(int(args[0]))
        if method == "list_loras":
            return sorted(self.list_loras())
        if method == "engine_state":
            self.check_invariants()
            kv = self.kv_manager
            return {"engine": self.engine_index, "used_blocks": kv.pool.num_used,
                    "num_blocks": kv.num_blocks, "running": len(self.scheduler.running),
                    "waiting": len(self.scheduler.waiting),
                    "swapped": len(self.scheduler.swapped), "groups": len(self.groups),
                    "preemptions": self.scheduler.num_preemptions}
        raise AssertionError(method)

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.shutdown()
        self.shutdown()


# --- the core's loop ---------------------------------------------------------------------------


@dataclasses.dataclass
class CoreConfig:
    """What a core process needs: its engine options, its index, its sockets (the front end
    binds them; the core connects) and the KV events' publishing."""

    args: EngineArgs
    engine_index: int
    input_address: str
    output_address: str
    kv_events: KVEventsConfig | None = None
    cpu_affinity: tuple[int, ...] = ()


class CoreLoop:
    """The busy loop of one core (see the module docstring)."""

    def __init__(self, engine: EngineCore, input_sock, output_sock) -> None:
        import zmq

        self.engine = engine
        self.input = input_sock
        self.output = output_sock
        self._poller = zmq.Poller()
        self._poller.register(input_sock, zmq.POLLIN)
        self._unpinned_failures = 0
        self._sent_counters = None

    def _recv_all(self, block: bool) -> list:
        import zmq

        frames = []
        if block:
            while not self._poller.poll(timeout=1000):
                pass
        while True:
            try:
                frames.append(self.input.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                return frames

    def run(self) -> None:
        engine = self.engine
        while True:
            frames = self._recv_all(block=not engine.has_unfinished_requests())
            out = CoreOutputs(engine.engine_index)
            accepted, refused, utility = [], [], []
            stop = False
            for frame in frames:
                msg = decode_input(frame)
                if isinstance(msg, CoreRequest):
                    try:
                        engine.add_core_request(msg)
                    except ValueError as e:
                        refused.append((msg.request_id, str(e)))
                    except Exception as e:  # noqa: BLE001 - the request's, not the core's
                        logger.exception("adding request %s failed", msg.request_id)
                        refused.append((msg.request_id, f"{type(e).__name__}: {e}"))
                    else:
                        accepted.append(msg.request_id)
                elif isinstance(msg, CoreAbort):
                    for request_id in msg.request_ids:
                        engine.abort_request(request_id)
                elif isinstance(msg, CoreStopSeqs):
                    engine.stop_seqs(msg.seqs)
                elif isinstance(msg, CoreUtility):
                    try:
                        utility.append((msg.call_id, True, engine.utility(msg.method, msg.args)))
                    except Exception as e:  # noqa: BLE001 - the caller's error
                        utility.append((msg.call_id, False, f"{type(e).__name__}: {e}"))
                elif isinstance(msg, CoreShutdown):
                    stop = True
            out.accepted, out.refused, out.utility = accepted, refused, utility
            if stop:
                self._send(out)
                return
            stepped = False
            if engine.has_unfinished_requests():
                out.deltas, out.failed = self._step()
                stepped = True
            if stepped or frames:
                out.stats = engine.core_stats()
                out.kv_events = engine.kv_events.take()
                if out.kv_events is not None and engine._publisher is not None:
                    engine._publisher.publish(out.kv_events)
                self._send(out)

    def _send(self, out: CoreOutputs) -> None:
        self.output.send(encode(out), copy=False)

    def _step(self) -> tuple[list[RequestDelta], list[tuple[str, str]]]:
        from pagedserve.worker.executor import WorkerDiedError

        engine = self.engine
        try:
            deltas = engine.step()
        except WorkerDiedError:
            raise  # the core is dead: the front end sees the process end
        except Exception as exc:
            blamed = [r for r in engine.step_request_ids() if r in engine.groups]
            if not blamed:
                self._unpinned_failures += 1
                if self._unpinned_failures >= 2:
                    raise
                logger.exception("a model step failed before scheduling any request; retrying")
                return [], []
            self._unpinned_failures = 0
            logger.exception("a model step failed; aborting its %d request(s)", len(blamed))
            for request_id in blamed:
                engine.abort_request(request_id)
            message = f"the model step computing this request failed: {exc!r}"
            return [], [(r, message) for r in blamed]
        self._unpinned_failures = 0
        return deltas, []


def _connect(config: CoreConfig):
    import zmq

    ctx = zmq.Context.instance()
    input_sock = ctx.socket(zmq.PULL)
    input_sock.connect(config.input_address)
    output_sock = ctx.socket(zmq.PUSH)
    output_sock.setsockopt(zmq.LINGER, 2000)
    output_sock.connect(config.output_address)
    return input_sock, output_sock


def serve_core(config: CoreConfig) -> None:
    """Build the core's engine, say ready, then run its loop until shut down (any failure ends
    the process after a last word to the front end's log)."""
    input_sock, output_sock = _connect(config)
    if config.cpu_affinity and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, config.cpu_affinity)
    engine = EngineCore(config.args, config.engine_index, config.kv_events)
    output_sock.send(encode(engine.ready_info()))
    try:
        CoreLoop(engine, input_sock, output_sock).run()
    finally:
        engine.close()
        input_sock.close(linger=0)
        output_sock.close()


def run_core_process(config: CoreConfig) -> None:
    """Entry point of a local core process (`--data-parallel-backend mp`).

    NOTE: SIGINT is ignored (Ctrl-C reaches the whole process group; the front end stops its
    cores), and the process exits when the front end's process dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from pagedserve.worker.mp_executor import _exit_with_parent

    _exit_with_parent()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s core{config.engine_index} %(levelname)s %(message)s")
    try:
        serve_core(config)
    except BaseException:  # noqa: BLE001 - logged; the front end sees the process end
        logger.exception("engine core %d died", config.engine_index)
        os._exit(1)


class CoreActor:
    """An engine core inside a Ray actor (`--data-parallel-backend ray`; wrapped with
    `ray.remote` when the client starts, so that importing this module needs no Ray)."""

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def run(self, config: CoreConfig) -> None:
        """Serve until shut down; an error ends the call (the front end's `ray.wait` sees it)."""
        serve_core(config)

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()


def now() -> float:
    return time.monotonic()
