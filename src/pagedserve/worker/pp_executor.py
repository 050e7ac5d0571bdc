"""Pipeline parallelism on Ray (`pipeline_parallel_size = P`): the decoder layers split into P
contiguous stages, one Ray actor each, micro-batches in flight so that the stages overlap.

Stage s holds layers `[a_s, a_{s+1})` (even shares, the first stages one more when P does not
divide them), the KV cache of those layers only (the same block count on every stage: the
scheduler's block tables hold on all of them), and runs `embed` (for the layers' RoPE inputs;
stage 0 also its token embeddings) and its layers; the last stage also the final norm, the LM
head and the sampler (the per-request generators live there).

A step: the driver's `StepEncoder` delta goes once into Ray's object store and every stage
decodes it into the same `StepInput` (the same persistent-batch protocol as tensor
parallelism). Its rows are then cut into M micro-batches (M = P by default, fewer for few rows);
for each micro-batch the driver chains `stage_0.run(m) -> stage_1.run(m, hidden) -> ...`, the
hidden states `[T_m, H]` passed as Ray object references, never through the driver. An actor
runs its calls in order, so stage 0 computes micro-batch m + 1 while stage 1 computes m: the
stages overlap (GPipe's schedule, within one step). The last stage's outputs are concatenated
in row order.

Exactness: a row's result does not depend on the rows beside it (float32 on CPU is
batch-invariant), and every micro-batch runs on the same sampler with the same generators, so
tokens and logprobs equal one stage's. The step's swap-out / swap-in / copy pairs go with the
first micro-batch on every stage (each moves its own layers' blocks); preemption and swapping
need nothing else. A step with grammar bitmasks (structured outputs) runs as one micro-batch.

NOTE: each stage loads the whole checkpoint and then drops the layers it does not run: the
running stages hold 1/P of the layers (and their KV cache), the load's peak is the whole model.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
import types
from typing import Any

import torch

from pagedserve.core.step_input import StepInput
from pagedserve.core.step_output import SeqStepOutput
from pagedserve.worker.executor_base import CommStats, Executor, WorkerDiedError
from pagedserve.worker.step_message import StepEncoder
from pagedserve.worker.worker import CacheConfig, ModelInfo, Worker, WorkerConfig

PLACEMENT_TIMEOUT_S = 120.0
HEALTH_TIMEOUT_S = 10.0


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """The `[first, last)` layers of `stage` (even shares, the first stages one more)."""
    base, extra = divmod(num_layers, num_stages)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)


class _Stage:
    """The part of the model one stage runs, installed on its decoder stack."""

    def __init__(self, model, first: int, last: int, is_first: bool, is_last: bool) -> None:
        self.first, self.last = first, last
        self.is_first, self.is_last = is_first, is_last
        self.input: torch.Tensor | None = None  # the previous stage's hidden states [T, H]
        self.output: torch.Tensor | None = None
        stack = model.backbone()
        layers = stack.decoder_layers()
        for i in range(len(layers)):
            if not first <= i < last:
                layers[i] = torch.nn.Identity()  # its weights freed: another stage runs it
        stage = self

        def forward(self, input_ids, positions, kv_caches, meta):  # [T] -> [T, H']
            x, extras = self.embed(input_ids, positions)  # [T, H]: RoPE inputs on every stage
            if not stage.is_first:
                x = stage.input  # [T, H]
            layers = self.decoder_layers()
            for j, i in enumerate(range(stage.first, stage.last)):
                x = layers[i](x, *extras[i], kv_caches[j], meta)  # [T, H]
            if not stage.is_last:
                stage.output = x
                return x
            return self.final(x)

        stack.forward = types.MethodType(forward, stack)
        if not is_last:  # no LM head runs here (the runner does not sample: sample=False)
            model.greedy_tokens = lambda hidden: None
            model.compute_logits = lambda hidden: hidden.new_zeros(hidden.shape[0], 1)
        spec = model.kv_cache_spec
        layers = spec.layer_specs()
        # NOTE: the engine lays out one pool of groups for every stage (the fullest stage's
        # spec): a model of several KV layer groups would need that layout per stage.
        if len(set(layers)) > 1:
            raise ValueError("pipeline_parallel_size > 1 with a model of several KV layer groups "
                             "(sliding-window, latent or sink layers beside full attention) is "
                             "not supported yet; use tensor_parallel_size or data_parallel_size")
        model.kv_cache_spec = dataclasses.replace(spec, num_layers=last - first,
                                                  layers=layers[first:last])


class StageActor:
    """One pipeline stage inside a Ray actor (wrapped with `ray.remote` when the executor
    starts, so that importing this module needs no Ray)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.stage: _Stage | None = None
        self.step: StepInput | None = None
        self.micro: list[StepInput] = []

    def start(self, config: WorkerConfig, stage: int, num_stages: int) -> ModelInfo:
        self.worker = Worker(config, 0, "", device_index=0)
        model = self.worker.model
        num_layers = len(model.backbone().decoder_layers())
        first, last = stage_layers(num_layers, num_stages, stage)
        self.stage = _Stage(model, first, last, stage == 0, stage == num_stages - 1)
        self.is_last = stage == num_stages - 1
        return self.worker.info()

    def init_cache(self, cache: CacheConfig) -> None:
        self.worker.init_cache(cache)
        self.worker.runner.sample = self.is_last

    def decode(self, payload: bytes, num_micro: int) -> int:
        """Apply the step's delta; cut its rows into micro-batches. Returns their number."""
        step = self.worker.decoder.decode(pickle.loads(payload))
        rows = step.rows
        m = 1 if step.grammar_bitmask is not None else max(1, min(num_micro, len(rows)))
        bounds = [len(rows) * k // m for k in range(m + 1)]
        self.micro = [step if m == 1 else dataclasses.replace(
            step, rows=rows[bounds[k]:bounds[k + 1]],
            blocks_to_swap_out=step.blocks_to_swap_out if k == 0 else [],
            blocks_to_swap_in=step.blocks_to_swap_in if k == 0 else [],
            blocks_to_copy=step.blocks_to_copy if k == 0 else [],
            finished_request_ids=step.finished_request_ids if k == 0 else [],
            freed_seq_ids=step.freed_seq_ids if k == 0 else []) for k in range(m)]
        return m

    def run(self, micro: int, hidden: torch.Tensor | None = None):
        """Micro-batch `micro` through this stage: the next stage's input (hidden states), or
        on the last stage its outputs."""
        sub = self.micro[micro]
        self.stage.input = hidden
        self.stage.output = None
        outputs = self.worker.execute_step(sub)
        if self.is_last:
            return outputs
        return self.stage.output if sub.rows else None

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class PipelineExecutor(Executor):
    """`num_stages` Ray actors, one per pipeline stage; see the module docstring."""

    def __init__(self, config: WorkerConfig, num_stages: int, address: str | None = None,
                 num_micro: int | None = None) -> None:
        super().__init__()
        try:
            import ray
        except ImportError as e:
            raise ValueError("pipeline_parallel_size > 1 runs on Ray: pip install "
                             "'pagedserve[ray]'") from e
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        self.num_stages = num_stages
        self.num_micro = num_micro or num_stages
        self.encoder = StepEncoder()
        self.stats = CommStats()
        self.micro_batches = 0  # micro-batches run (over all steps)
        self._closed = False
        self._actors: list[Any] = []
        gpu = config.device_type == "cuda"
        bundle = {"CPU": 1.0, "GPU": 1.0} if gpu else {"CPU": 1.0}
        self._pg = placement_group([bundle] * num_stages, strategy="PACK")
        try:
            try:
                ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise ValueError(
                    f"the Ray cluster has no room for {num_stages} pipeline stages of {bundle} "
                    f"(available: {ray.available_resources()})") from None
            actor_class = ray.remote(StageActor)
            for stage in range(num_stages):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=stage)
                self._actors.append(actor_class.options(
                    num_cpus=1, num_gpus=1 if gpu else 0, max_concurrency=1,
                    scheduling_strategy=strategy).remote())
            infos = self._get([actor.start.remote(config, stage, num_stages)
                               for stage, actor in enumerate(self._actors)])
        except BaseException:
            self.shutdown()
            raise
        # the block budget is per stage: sized by the stage holding the most layers
        self.kv_cache_spec = max((i.kv_cache_spec for i in infos), key=lambda s: s.num_layers)
        self.num_params = infos[0].num_params
        self.draft_kv_cache_spec = None

    def init_cache(self, cache: CacheConfig) -> None:
        self._get([actor.init_cache.remote(cache) for actor in self._actors])
        self.encoder.reset()

    def execute(self, step: StepInput) -> list[SeqStepOutput]:
        super().check_health()
        start = time.perf_counter()
        payload = pickle.dumps(self.encoder.encode(step), protocol=pickle.HIGHEST_PROTOCOL)
        ref = self._ray.put(payload)
        counts = self._get([actor.decode.remote(ref, self.num_micro) for actor in self._actors])
        last = []
        self.micro_batches += counts[0]
        for m in range(counts[0]):
            hidden = None
            for actor in self._actors:
                hidden = actor.run.remote(m, hidden)
            last.append(hidden)
        outputs: list[SeqStepOutput] = []
        for part in self._get(last):
            outputs.extend(part)
        self.stats.record(len(payload), 0, time.perf_counter() - start, 0.0)
        return outputs

    def check_health(self) -> None:
        super().check_health()
        try:
            self._ray.get([a.ping.remote() for a in self._actors], timeout=HEALTH_TIMEOUT_S)
        except self._ray.exceptions.RayError as e:
            raise self._fail(WorkerDiedError(f"a pipeline stage (Ray actor) is gone: {e}")) from None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self._pg)
        if self._owns_ray:
            ray.shutdown()

    def _get(self, refs: list) -> list[Any]:
        """The results in order; `WorkerDiedError` at the first failure."""
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayError as e:
            raise self._fail(WorkerDiedError(f"a pipeline stage (Ray actor) failed: {e}")) from None
