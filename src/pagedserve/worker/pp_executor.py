"""Pipeline parallelism on Ray (`pipeline_parallel_size = P`): the decoder layers split into P
contiguous stages, one Ray actor each, micro-batches in flight so that the stages overlap.

Stage s holds layers `[a_s, a_{s+1})` (even shares, the first stages one more when P does not
divide them), the KV cache of those layers only, and runs `embed` (for the layers' RoPE inputs;
stage 0 also its token embeddings) and its layers; the last stage also the final norm, the LM
head and the sampler (the per-request generators live there).

The KV cache: every stage lays out the whole model's layer groups (core/kv_spec.py: sliding
window, full, latent), so the scheduler's block tables -- one column per group lane -- and its
per-group block accounting are those of one stage, unchanged, and hold on every stage; the same
block count everywhere. A stage allocates only the layer slots of its own layers
(`KVCacheSpec.stages`, `worker.kv_cache.held_slots`), and the engine sizes a block by the stage
holding the most. A model of one group (every layer in one lane) thus keeps 1/P of its KV per
stage; a hybrid model's lane that spans a stage cut is allocated on both stages.

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

from pagedserve.core.kv_spec import RecurrentStateSpec
from pagedserve.core.step_input import StepInput
from pagedserve.core.step_output import SeqStepOutput
from pagedserve.platforms import platform_for
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
        # stages split cache entries by layer; a recurrent layer reads a list of entries
        recurrent = any(isinstance(s, RecurrentStateSpec) for s in model.kv_cache_spec.layer_specs())
        if model.kv_cache_spec.num_layers != len(layers) or recurrent:
            raise ValueError(f"pipeline_parallel_size > 1 needs one cache entry per layer; "
                             f"{type(model).__name__} has {model.kv_cache_spec.num_layers} for "
                             f"{len(layers)} layers (short-convolution or recurrent state): not "
                             "supported yet")
        for i in range(len(layers)):
            if not first <= i < last:
                layers[i] = torch.nn.Identity()  # its weights freed: another stage runs it
        stage = self

        def forward(self, input_ids, positions, kv_caches, meta):  # [T] -> [T, H']
            x, extras = self.embed(input_ids, positions)  # [T, H]: RoPE inputs on every stage
            if not stage.is_first:
                x = stage.input  # [T, H]
            layers = self.decoder_layers()
            # NOTE: `kv_caches` and `meta.per_layer` (several KV groups: each layer's column)
            # are indexed by model layer; the other stages' entries hold no tensors.
            metas = meta.per_layer
            for i in range(stage.first, stage.last):
                m = metas[i] if metas else meta
                x = layers[i](x, *extras[i], kv_caches[i], m)  # [T, H]
            if not stage.is_last:
                stage.output = x
                return x
            return self.final(x)

        stack.forward = types.MethodType(forward, stack)
        if not is_last:  # no LM head runs here (the runner does not sample: sample=False)
            model.greedy_tokens = lambda hidden: None
            model.compute_logits = lambda hidden: hidden.new_zeros(hidden.shape[0], 1)
        # The whole model's layer specs (its groups' layout), this stage's layers' slots held.
        model.kv_cache_spec = dataclasses.replace(model.kv_cache_spec, stages=((first, last),))


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
        self._setup(num_stages, num_micro)
        bundle = platform_for(config.device_type).worker_bundle()
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
                    num_cpus=1, num_gpus=bundle.get("GPU", 0), max_concurrency=1,
                    scheduling_strategy=strategy).remote())
            infos = self._get([actor.start.remote(config, stage, num_stages)
                               for stage, actor in enumerate(self._actors)])
        except BaseException:
            self.shutdown()
            raise
        self._adopt(infos)

    @classmethod
    def in_process(cls, config: WorkerConfig, num_stages: int,
                   num_micro: int | None = None) -> "PipelineExecutor":
        """The stages as objects in this process, called one after the other (no overlap, no
        Ray): the same stage code, micro-batches and block operations as on Ray, for tests and
        debugging."""
        self = cls.__new__(cls)
        Executor.__init__(self)
        self._ray, self._owns_ray, self._pg = _InProcessRay, False, None
        self._setup(num_stages, num_micro)
        try:
            self._actors = [_InProcessHandle(StageActor()) for _ in range(num_stages)]
            self._adopt([actor.start.remote(config, stage, num_stages)
                         for stage, actor in enumerate(self._actors)])
        except BaseException:
            self.shutdown()
            raise
        return self

    def _setup(self, num_stages: int, num_micro: int | None) -> None:
        self.num_stages = num_stages
        self.num_micro = num_micro or num_stages
        self.encoder = StepEncoder()
        self.stats = CommStats()
        self.micro_batches = 0  # micro-batches run (over all steps)
        self._closed = False
        self._actors: list[Any] = []

    def _adopt(self, infos: list[ModelInfo]) -> None:
        """The engine's view of the started stages: one KV layout for all of them, a block's
        bytes those of the stage holding the most layer slots (worker.kv_cache.bytes_per_block)."""
        self.kv_cache_spec = dataclasses.replace(
            infos[0].kv_cache_spec, stages=tuple(s for i in infos for s in i.kv_cache_spec.stages))
        self.num_params = infos[0].num_params
        self.draft_kv_cache_spec = None

    def init_cache(self, cache: CacheConfig) -> None:
        self._get([actor.init_cache.remote(cache) for actor in self._actors])

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
        if self._pg is None:  # in process
            for actor in self._actors:
                actor.close.remote()
            return
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


class _InProcessHandle:
    """A stage object called as a Ray actor handle: `handle.method.remote(*args)` runs the
    method at once and returns its result (the "object reference")."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        return types.SimpleNamespace(remote=getattr(self._obj, name))


class _InProcessRay:
    """What the executor calls of Ray, for stages in this process: references are values."""

    class exceptions:  # noqa: N801 -- Ray's names
        RayError = ()  # nothing to catch: a stage's exception propagates as it is

    @staticmethod
    def put(value: Any) -> Any:
        return value

    @staticmethod
    def get(refs: Any, timeout: float | None = None) -> Any:
        return refs
