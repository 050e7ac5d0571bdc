"""The data of entrypoints/vllm_flags.py: vLLM 0.32's `serve --help=all` flags, one row each
(help group | spellings | argument shape | how pagedserve handles it | reason key), and the
reasons a flag is ignored or refused, by key. Edit a row here when pagedserve gains (or drops)
a flag; tests/entrypoints/test_vllm_flags.py checks the rows against vLLM's list."""

# Why a flag is ignored or refused, by key (the last column of the table).
REASONS = {
    'trust-request-chat-template': "a request's chat_template is always accepted here (rendered in jinja2's sandbox, as the model's own)",
    'async-scheduling': "the engine steps synchronously here: on CPU the step is the model; tokenizing, rendering and building answers already run apart from the engine thread",
    'moe': 'a GPU expert-parallel / expert-load-balancing knob: our MoE layer (layers/moe.py) shards experts along their width, or whole experts with --enable-expert-parallel, over the tensor-parallel ranks with one all-reduce',
    'text-only': 'the models served here are text-only',
    'mamba': 'Mamba / state-space states are kept in float32 in the paged cache, one block per sequence, and prefix caching snapshots them at block boundaries and at shared-prefix junctions (core/state_snapshots.py): their dtype, block size, cache mode and kernels take no setting here',
    'cuda': "a CUDA-only knob (vLLM's GPU path); pagedserve's CUDA path needs no setting",
    'code': 'it loads Python code named on the command line; pagedserve loads no code from outside its package',
    'multinode': 'several nodes, external load balancers and API-server replicas are not built: data-parallel engine cores run on this machine (mp) or a Ray cluster behind one front end (--data-parallel-size, --data-parallel-backend, --data-parallel-routing)',
    'grpc': 'no gRPC front end here: the OpenAI-compatible HTTP server only',
    'fail-on-environ-validation': 'pagedserve validates no VLLM_* environment variables (it reads VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND only)',
    'gdn-prefill-backend': "Gated DeltaNet layers run pagedserve's own kernel (token by token in one fixed order: batch- and chunk-invariant); there is no backend to choose",
    'kda-prefill-backend': "Kimi Delta Attention layers run pagedserve's own kernel (token by token in one fixed order); there is no backend to choose",
    'tool-parser-plugin': 'it loads Python code named on the command line; pagedserve loads no code from outside its package; name a built-in parser with --tool-call-parser',
    'tool-strict-level': "tool_choice 'required' and named tools are always constrained to the whole schema here; 'auto' calls are parsed, not constrained",
    'tool-server': 'no built-in tool server (MCP / demo tools) here',
    'enable-per-request-metrics': 'per-request timings are not returned in responses here (they are in /metrics)',
    'sse-keep-alive-interval': 'streams send no keep-alive comments here',
    'enable-log-deltas': "streamed deltas are not logged one by one here; --enable-log-outputs logs each request's whole output",
    'cohere-is-reasoning-model': 'no Cohere API routes here',
    'anthropic-disabled-thinking-effort': "thinking is switched off through the chat template's enable_thinking here",
    'log-error-stack': 'unhandled errors are always logged with their stack here',
    'tokens-only': 'the tokens-only front end (disaggregated serving) is not here',
    'fingerprint-mode': 'responses carry no system_fingerprint here',
    'enable-ssl-refresh': 'certificates are read once, at start, here',
    'middleware': 'it loads Python code named on the command line; pagedserve loads no code from outside its package; put such middleware in a proxy in front',
    'h11-max-header-count': "uvicorn's own h11 limits apply here",
    'enable-offline-docs': "the /docs pages are FastAPI's, which load their assets from a CDN",
    'enable-flash-late-interaction': 'no late-interaction (ColBERT) scoring here',
    'tokenizer-mode': "tokenizers are HF fast tokenizers (tokenizer.json) here; 'auto' and 'hf' are the same",
    'hf-config-path': "the config is read from the model's own folder or GGUF here",
    'code-revision': 'no model code is ever run here (see --trust-remote-code)',
    'quantization-config': "no per-method settings: --quantization none | gguf | int8 | awq | gptq | compressed-tensors | fp8",
    'allow-deprecated-quantization': 'no deprecated quantization method here',
    'return-sampling-mask': 'sampling masks are not returned here',
    'logprobs-mode': "logprobs are the model's raw log-softmax here (vLLM's default)",
    'use-fp64-gumbel': 'the sampler draws by inverse CDF per row here, not with Gumbel noise',
    'enable-trace-replay': 'trace replay is not here',
    'disable-sliding-window': "sliding windows are the model's here (Gemma 3's local layers keep theirs)",
    'disable-cascade-attn': 'no cascade attention here',
    'enable-prompt-embeds': 'prompts are text or token ids here, not embeddings',
    'config-format': "configs are HF config.json (or a GGUF's header) here",
    'model-class-overrides': "models are pagedserve's own classes, chosen by architecture",
    'enable-sleep-mode': 'sleep / wake_up need no special allocator here (the KV cache is freed and reallocated)',
    'sleep-preserve-parameter-names': 'weights stay where they are during sleep here',
    'model-impl': "models are pagedserve's own implementations (no transformers fallback)",
    'renderer-num-workers': "chat templates are rendered on the server's CPU pool here",
    'safetensors-load-strategy': 'safetensors files are memory-mapped and read tensor by tensor here',
    'model-loader-extra-config': 'no loader plug-ins here',
    'ignore-patterns': 'hub downloads fetch only *.json, *.safetensors and tokenizer files here',
    'use-tqdm-on-load': 'loading shows no progress bar here',
    'pt-load-map-location': 'pickled .pt / .bin checkpoints are never loaded here',
    'reasoning-parser-plugin': 'it loads Python code named on the command line; pagedserve loads no code from outside its package; name a built-in parser with --reasoning-parser',
    'distributed-timeout-seconds': 'the worker process groups use their defaults here',
    'numa-bind': 'pin the compute threads with --cpu-threads-bind (VLLM_CPU_OMP_THREADS_BIND) here',
    'device-ids': 'choose the device with --device cuda:N here',
    'decode-context-parallel-size': 'context parallelism is not here',
    'enable-hc-sp': 'sequence parallelism is not here',
    'enable-batch-sharded-sampling': 'sampling runs on the driver, once per step, here',
    'enable-dbo': 'dual-batch overlap hides GPU all-to-all time: no mixture-of-experts model is served here',
    'enable-shm-tensor-arena': 'workers exchange plain-data step deltas here (worker/step_message.py)',
    'ubatch-size': 'dual-batch overlap is not here',
    'max-parallel-loading-workers': 'each worker loads its own shard here',
    'enable-fault-tolerance': 'a dead worker stops the server here (it exits non-zero for a supervisor to restart)',
    'prefix-caching-hash-algo': 'prefix blocks are keyed by their chained token ids here (no hash collisions to weigh)',
    'prefix-cache-retention-interval': 'cached prefix blocks stay until the pool needs them (least recently freed first) here',
    'kv-cache-dtype-skip-layers': "every layer's KV blocks share one dtype here",
    'kv-sharing-fast-prefill': 'no cross-layer KV sharing in the models served here',
    'swa-bounded-replay': 'sliding-window layers keep whole blocks here',
    'prefix-match-unit': 'prefixes are matched by whole blocks (--block-size) here',
    'kv-offloading-size': 'KV offloading is not here: preempted requests swap to the CPU pool (--swap-space)',
    'offload-backend': 'the weights are in host memory already on CPU; on CUDA they are not offloaded here',
    'cpu-offload-gb': 'weights are not offloaded to host memory here (on CPU they are there already)',
    'cpu-offload-params': 'weights are not offloaded here',
    'lora-dtype': "adapters run in the model's dtype here",
    'fully-sharded-loras': 'LoRA adapters run with one worker here (tensor_parallel_size=1)',
    'lora-target-modules': 'an adapter applies to the modules its PEFT config names here',
    'specialize-active-lora': 'the LoRA kernels take any mix of adapters per step here',
    'max-lora-cls-labels': 'no LoRA classification heads here',
    'logging-config': 'configure logging with --log-config-file (a logging.config dict as JSON) here',
    'show-hidden-metrics-for-version': 'no metric has been hidden here',
    'otlp-traces-endpoint': 'OpenTelemetry tracing is not here',
    'per-request-spec-decode-metrics': "speculative decoding's counters are in /metrics only here",
    'kv-cache-metrics': 'the KV usage is always in /metrics (kv_cache_usage_perc)',
    'custom-histogram-buckets': "the histograms keep vLLM's default buckets here",
    'enable-mfu-metrics': 'no MFU metrics here (bench latency reports the roofline)',
    'enable-logging-iteration-details': 'the stats line is per interval here (--log-stats-interval)',
    'jit-monitor-mode': 'no torch.compile here',
    'max-num-scheduled-tokens': "a step's tokens are bounded by --max-num-batched-tokens here",
    'max-num-active-seqs': 'running sequences are bounded by --max-num-seqs here',
    'max-num-queued-tokens': 'the queue is bounded in requests (--max-num-queued-reqs) here',
    'long-prefill-token-threshold-adaptive': 'the threshold is fixed here',
    'scheduler-reserve-full-isl': "a prompt's blocks are allocated as its chunks are scheduled here",
    'watermark': 'admission keeps no free-block watermark here: preemption recovers',
    'prefill-schedule-interval': 'prompts are scheduled at every step here',
    'cudagraph-capture-sizes': "no CUDA graphs on CPU; pagedserve's CUDA path captures its own sizes",
    'ir-op-priority': 'the CPU kernels are chosen by ISA level here (PAGEDSERVE_CPU_ISA)',
    'sparse-indexer-topk-backend': 'no sparse-attention indexer here',
    'watermark-config': 'text watermarking is not here',
    'diffusion-config': 'no diffusion model is served here',
    'kv-transfer-config': 'disaggregated prefill (KV transfer) is not here',
    'ec-transfer-config': 'encoder-cache transfer is not here',
    'compilation-config': 'no torch.compile here: the CPU kernels are compiled ahead (csrc)',
    'attention-config': 'choose the attention backend with --attention-backend here',
    'engram-config': 'engram memory is not here',
    'reasoning-config': 'reasoning is configured by --reasoning-parser and the chat template here',
    'additional-config': 'no platform plug-ins here',
    'aux-output-config': 'no auxiliary outputs here',
    'profiler-config': "profile with --enable-debug-endpoints' /debug/profile here",
    'performance-mode': 'the kernels are chosen per batch shape here',
    'weight-transfer-config': 'weight transfer (RL weight sync) is not here',
}

_TABLE = """
options                 | -h --help                                            | help     | supported         |
options                 | --headless                                           | flag     | refused           | multinode
options                 | --api-server-count -asc                              | value    | refused           | multinode
options                 | --config                                             | value    | supported         |
options                 | --grpc                                               | flag     | refused           | grpc
options                 | --disable-log-stats                                  | flag     | supported         |
options                 | --aggregate-engine-logging                           | flag     | refused           | multinode
options                 | --fail-on-environ-validation                         | bool     | ignored           | fail-on-environ-validation
options                 | --shutdown-timeout                                   | value    | supported         |
options                 | --gdn-prefill-backend                                | value    | ignored           | gdn-prefill-backend
options                 | --kda-prefill-backend                                | value    | ignored           | kda-prefill-backend
options                 | --kda-decode-backend                                 | value    | ignored           | kda-prefill-backend
options                 | --enable-log-requests                                | bool     | supported         |
Frontend                | --lora-modules                                       | list     | supported         |
Frontend                | --chat-template                                      | value    | supported         |
Frontend                | --chat-template-content-format                       | value    | supported         |
Frontend                | --trust-request-chat-template                        | bool     | ignored           | trust-request-chat-template
Frontend                | --trust-request-mm-kwargs                            | bool     | ignored           | text-only
Frontend                | --default-chat-template-kwargs                       | value    | supported         |
Frontend                | --response-role                                      | value    | supported         |
Frontend                | --return-tokens-as-token-ids                         | bool     | supported         |
Frontend                | --enable-auto-tool-choice                            | bool     | supported         |
Frontend                | --exclude-tools-when-tool-choice-none                | bool     | supported         |
Frontend                | --tool-call-parser                                   | value    | supported         |
Frontend                | --tool-parser-plugin                                 | value    | refused           | tool-parser-plugin
Frontend                | --tool-strict-level                                  | value    | ignored           | tool-strict-level
Frontend                | --tool-server                                        | value    | refused           | tool-server
Frontend                | --max-log-len                                        | value    | supported         |
Frontend                | --enable-prompt-tokens-details                       | bool     | supported         |
Frontend                | --enable-per-request-metrics                         | bool     | refused           | enable-per-request-metrics
Frontend                | --enable-server-load-tracking                        | bool     | supported         |
Frontend                | --enable-force-include-usage                         | bool     | supported         |
Frontend                | --sse-keep-alive-interval                            | value    | ignored           | sse-keep-alive-interval
Frontend                | --enable-tokenizer-info-endpoint                     | bool     | supported         |
Frontend                | --enable-log-outputs                                 | bool     | supported         |
Frontend                | --enable-log-deltas                                  | bool     | ignored           | enable-log-deltas
Frontend                | --cohere-is-reasoning-model                          | bool     | ignored           | cohere-is-reasoning-model
Frontend                | --cohere-format                                      | value    | ignored           | cohere-is-reasoning-model
Frontend                | --anthropic-disabled-thinking-effort                 | value    | ignored           | anthropic-disabled-thinking-effort
Frontend                | --log-error-stack                                    | bool     | ignored           | log-error-stack
Frontend                | --tokens-only                                        | bool     | refused           | tokens-only
Frontend                | --enable-scale-out                                   | bool     | refused           | multinode
Frontend                | --fingerprint-mode                                   | value    | ignored           | fingerprint-mode
Frontend                | --fingerprint-value                                  | value    | ignored           | fingerprint-mode
Frontend                | --host                                               | value    | supported         |
Frontend                | --port                                               | value    | supported         |
Frontend                | --grpc-port                                          | value    | refused           | grpc
Frontend                | --data-parallel-supervisor-port                      | value    | refused           | multinode
Frontend                | --dp-supervisor-probe-interval-s                     | value    | refused           | multinode
Frontend                | --dp-supervisor-probe-timeout-s                      | value    | refused           | multinode
Frontend                | --dp-supervisor-probe-failure-threshold              | value    | refused           | multinode
Frontend                | --uds                                                | value    | supported         |
Frontend                | --uvicorn-log-level                                  | value    | supported         |
Frontend                | --disable-uvicorn-access-log                         | bool     | supported         |
Frontend                | --disable-access-log-for-endpoints                   | value    | supported         |
Frontend                | --allow-credentials                                  | bool     | supported         |
Frontend                | --allowed-origins                                    | value    | supported         |
Frontend                | --allowed-methods                                    | value    | supported         |
Frontend                | --allowed-headers                                    | value    | supported         |
Frontend                | --api-key                                            | list     | supported         |
Frontend                | --ssl-keyfile                                        | value    | supported         |
Frontend                | --ssl-certfile                                       | value    | supported         |
Frontend                | --ssl-ca-certs                                       | value    | supported         |
Frontend                | --enable-ssl-refresh                                 | bool     | refused           | enable-ssl-refresh
Frontend                | --ssl-cert-reqs                                      | value    | supported         |
Frontend                | --ssl-ciphers                                        | value    | supported         |
Frontend                | --root-path                                          | value    | supported         |
Frontend                | --middleware                                         | append   | refused           | middleware
Frontend                | --enable-request-id-headers                          | bool     | supported         |
Frontend                | --disable-fastapi-docs                               | bool     | supported         |
Frontend                | --h11-max-incomplete-event-size                      | value    | supported         |
Frontend                | --h11-max-header-count                               | value    | ignored           | h11-max-header-count
Frontend                | --enable-offline-docs                                | bool     | ignored           | enable-offline-docs
Frontend                | --enable-flash-late-interaction                      | bool     | ignored           | enable-flash-late-interaction
ModelConfig             | --model                                              | value    | supported         |
ModelConfig             | --runner                                             | value    | supported         |
ModelConfig             | --convert                                            | value    | supported         |
ModelConfig             | --tokenizer                                          | value    | supported         |
ModelConfig             | --tokenizer-mode                                     | value    | only auto,hf      | tokenizer-mode
ModelConfig             | --trust-remote-code                                  | bool     | supported         |
ModelConfig             | --dtype                                              | value    | supported         |
ModelConfig             | --seed                                               | value    | supported         |
ModelConfig             | --hf-config-path                                     | value    | refused           | hf-config-path
ModelConfig             | --allowed-local-media-path                           | value    | ignored           | text-only
ModelConfig             | --allowed-media-domains                              | list     | ignored           | text-only
ModelConfig             | --revision                                           | value    | supported         |
ModelConfig             | --code-revision                                      | value    | ignored           | code-revision
ModelConfig             | --tokenizer-revision                                 | value    | supported         |
ModelConfig             | --max-model-len                                      | value    | supported         |
ModelConfig             | --quantization -q                                    | value    | supported         |
ModelConfig             | --quantization-config                                | value    | refused           | quantization-config
ModelConfig             | --allow-deprecated-quantization                      | bool     | ignored           | allow-deprecated-quantization
ModelConfig             | --enforce-eager                                      | bool     | supported         |
ModelConfig             | --enable-return-routed-experts                       | bool     | ignored           | moe
ModelConfig             | --return-sampling-mask                               | bool     | refused           | return-sampling-mask
ModelConfig             | --max-logprobs                                       | value    | supported         |
ModelConfig             | --logprobs-mode                                      | value    | only raw_logprobs | logprobs-mode
ModelConfig             | --use-fp64-gumbel                                    | bool     | ignored           | use-fp64-gumbel
ModelConfig             | --enable-trace-replay                                | bool     | refused           | enable-trace-replay
ModelConfig             | --disable-sliding-window                             | bool     | refused           | disable-sliding-window
ModelConfig             | --disable-cascade-attn                               | bool     | ignored           | disable-cascade-attn
ModelConfig             | --skip-tokenizer-init                                | bool     | supported         |
ModelConfig             | --enable-prompt-embeds                               | bool     | refused           | enable-prompt-embeds
ModelConfig             | --served-model-name                                  | list     | supported         |
ModelConfig             | --config-format                                      | value    | only auto,hf      | config-format
ModelConfig             | --hf-token                                           | optional | supported         |
ModelConfig             | --hf-overrides                                       | value    | supported         |
ModelConfig             | --model-class-overrides                              | value    | refused           | model-class-overrides
ModelConfig             | --pooler-config                                      | value    | supported         |
ModelConfig             | --generation-config                                  | value    | supported         |
ModelConfig             | --override-generation-config                         | value    | supported         |
ModelConfig             | --enable-sleep-mode                                  | bool     | ignored           | enable-sleep-mode
ModelConfig             | --sleep-mode-offload-cudagraph                       | bool     | ignored           | cuda
ModelConfig             | --sleep-preserve-parameter-names                     | list     | ignored           | sleep-preserve-parameter-names
ModelConfig             | --enable-cumem-allocator                             | bool     | ignored           | cuda
ModelConfig             | --enable-nccl-comm-suspend                           | bool     | ignored           | cuda
ModelConfig             | --model-impl                                         | value    | only auto,vllm    | model-impl
ModelConfig             | --logits-processors                                  | list     | refused           | code
ModelConfig             | --io-processor-plugin                                | value    | refused           | code
ModelConfig             | --renderer-num-workers                               | value    | ignored           | renderer-num-workers
LoadConfig              | --load-format                                        | value    | supported         |
LoadConfig              | --download-dir                                       | value    | supported         |
LoadConfig              | --safetensors-load-strategy                          | value    | ignored           | safetensors-load-strategy
LoadConfig              | --safetensors-prefetch-num-threads                   | value    | ignored           | safetensors-load-strategy
LoadConfig              | --safetensors-prefetch-block-size                    | value    | ignored           | safetensors-load-strategy
LoadConfig              | --model-loader-extra-config                          | value    | ignored           | model-loader-extra-config
LoadConfig              | --ignore-patterns                                    | list     | ignored           | ignore-patterns
LoadConfig              | --use-tqdm-on-load                                   | bool     | ignored           | use-tqdm-on-load
LoadConfig              | --pt-load-map-location                               | value    | ignored           | pt-load-map-location
AttentionConfig         | --attention-backend                                  | value    | supported         |
MambaConfig             | --mamba-backend                                      | value    | ignored           | mamba
MambaConfig             | --mamba-ssu-algorithm                                | value    | ignored           | mamba
MambaConfig             | --enable-mamba-cache-stochastic-rounding             | bool     | ignored           | mamba
MambaConfig             | --mamba-cache-philox-rounds                          | value    | ignored           | mamba
StructuredOutputsConfig | --reasoning-parser                                   | value    | supported         |
StructuredOutputsConfig | --reasoning-parser-plugin                            | value    | refused           | reasoning-parser-plugin
ParallelConfig          | --distributed-executor-backend                       | value    | supported         |
ParallelConfig          | --pipeline-parallel-size -pp                         | value    | supported         |
ParallelConfig          | --master-addr                                        | value    | refused           | multinode
ParallelConfig          | --master-port                                        | value    | refused           | multinode
ParallelConfig          | --nnodes -n                                          | value    | refused           | multinode
ParallelConfig          | --node-rank -r                                       | value    | refused           | multinode
ParallelConfig          | --distributed-timeout-seconds                        | value    | ignored           | distributed-timeout-seconds
ParallelConfig          | --cpu-distributed-timeout-seconds                    | value    | ignored           | distributed-timeout-seconds
ParallelConfig          | --numa-bind                                          | bool     | ignored           | numa-bind
ParallelConfig          | --numa-bind-nodes                                    | list     | refused           | numa-bind
ParallelConfig          | --numa-bind-cpus                                     | list     | refused           | numa-bind
ParallelConfig          | --device-ids                                         | value    | refused           | device-ids
ParallelConfig          | --tensor-parallel-size -tp                           | value    | supported         |
ParallelConfig          | --decode-context-parallel-size -dcp                  | value    | refused           | decode-context-parallel-size
ParallelConfig          | --dcp-comm-backend                                   | value    | refused           | decode-context-parallel-size
ParallelConfig          | --dcp-q-replicate                                    | bool     | refused           | decode-context-parallel-size
ParallelConfig          | --dcp-kv-cache-interleave-size                       | value    | refused           | decode-context-parallel-size
ParallelConfig          | --cp-kv-cache-interleave-size                        | value    | refused           | decode-context-parallel-size
ParallelConfig          | --prefill-context-parallel-size -pcp                 | value    | refused           | decode-context-parallel-size
ParallelConfig          | --data-parallel-size -dp                             | value    | supported         |
ParallelConfig          | --data-parallel-rank -dpn                            | value    | refused           | multinode
ParallelConfig          | --data-parallel-start-rank -dpr                      | value    | refused           | multinode
ParallelConfig          | --data-parallel-size-local -dpl                      | value    | refused           | multinode
ParallelConfig          | --data-parallel-address -dpa                         | value    | refused           | multinode
ParallelConfig          | --data-parallel-rpc-port -dpp                        | value    | refused           | multinode
ParallelConfig          | --data-parallel-backend -dpb                         | value    | supported         |
ParallelConfig          | --data-parallel-hybrid-lb -dph                       | bool     | refused           | multinode
ParallelConfig          | --data-parallel-external-lb -dpe                     | bool     | refused           | multinode
ParallelConfig          | --data-parallel-multi-port-external-lb -dpm          | flag     | refused           | multinode
ParallelConfig          | --enable-hc-sp                                       | bool     | refused           | enable-hc-sp
ParallelConfig          | --enable-expert-parallel -ep                         | bool     | supported         |
ParallelConfig          | --enable-batch-sharded-sampling                      | bool     | ignored           | enable-batch-sharded-sampling
ParallelConfig          | --enable-ep-weight-filter                            | bool     | ignored           | moe
ParallelConfig          | --all2all-backend                                    | value    | ignored           | moe
ParallelConfig          | --enable-dbo                                         | bool     | ignored           | enable-dbo
ParallelConfig          | --enable-shm-tensor-arena                            | bool     | ignored           | enable-shm-tensor-arena
ParallelConfig          | --ubatch-size                                        | value    | ignored           | ubatch-size
ParallelConfig          | --enable-elastic-ep                                  | bool     | ignored           | moe
ParallelConfig          | --elastic-ep-max-dp-size                             | value    | ignored           | moe
ParallelConfig          | --dbo-decode-token-threshold                         | value    | ignored           | ubatch-size
ParallelConfig          | --dp-sync-interval                                   | value    | refused           | multinode
ParallelConfig          | --dbo-prefill-token-threshold                        | value    | ignored           | ubatch-size
ParallelConfig          | --disable-nccl-for-dp-synchronization                | bool     | refused           | multinode
ParallelConfig          | --enable-eplb                                        | bool     | ignored           | moe
ParallelConfig          | --eplb-config                                        | value    | ignored           | moe
ParallelConfig          | --expert-placement-strategy                          | value    | ignored           | moe
ParallelConfig          | --max-parallel-loading-workers                       | value    | ignored           | max-parallel-loading-workers
ParallelConfig          | --ray-workers-use-nsight                             | bool     | ignored           | cuda
ParallelConfig          | --disable-custom-all-reduce                          | bool     | ignored           | cuda
ParallelConfig          | --worker-cls                                         | value    | only auto         | code
ParallelConfig          | --worker-extension-cls                               | value    | only              | code
ParallelConfig          | --enable-fault-tolerance                             | bool     | refused           | enable-fault-tolerance
ParallelConfig          | --fault-tolerance-config                             | value    | refused           | enable-fault-tolerance
CacheConfig             | --block-size                                         | value    | supported         |
CacheConfig             | --gpu-memory-utilization --device-memory-utilization | value    | supported         |
CacheConfig             | --kv-cache-memory-bytes                              | value    | supported         |
CacheConfig             | --kv-cache-dtype                                     | value    | supported         |
CacheConfig             | --num-gpu-blocks-override                            | value    | supported         |
CacheConfig             | --enable-prefix-caching                              | bool     | supported         |
CacheConfig             | --prefix-caching-hash-algo                           | value    | ignored           | prefix-caching-hash-algo
CacheConfig             | --prefix-cache-retention-interval                    | value    | ignored           | prefix-cache-retention-interval
CacheConfig             | --kv-cache-dtype-skip-layers                         | list     | ignored           | kv-cache-dtype-skip-layers
CacheConfig             | --kv-sharing-fast-prefill                            | bool     | ignored           | kv-sharing-fast-prefill
CacheConfig             | --swa-bounded-replay                                 | bool     | ignored           | swa-bounded-replay
CacheConfig             | --mamba-cache-dtype                                  | value    | ignored           | mamba
CacheConfig             | --mamba-ssm-cache-dtype                              | value    | ignored           | mamba
CacheConfig             | --mamba-block-size                                   | value    | ignored           | mamba
CacheConfig             | --prefix-match-unit                                  | value    | ignored           | prefix-match-unit
CacheConfig             | --mamba-cache-mode                                   | value    | ignored           | mamba
CacheConfig             | --enable-mamba-shared-prefix-checkpoint              | bool     | ignored           | mamba
CacheConfig             | --replayssm-buffer-len                               | value    | ignored           | mamba
CacheConfig             | --use-replayssm                                      | bool     | ignored           | mamba
CacheConfig             | --kv-offloading-size                                 | value    | refused           | kv-offloading-size
CacheConfig             | --kv-offloading-backend                              | value    | refused           | kv-offloading-size
OffloadConfig           | --offload-backend                                    | value    | ignored           | offload-backend
OffloadConfig           | --cpu-offload-gb                                     | value    | refused           | cpu-offload-gb
OffloadConfig           | --cpu-offload-params                                 | list     | ignored           | cpu-offload-params
OffloadConfig           | --offload-group-size                                 | value    | ignored           | cpu-offload-params
OffloadConfig           | --offload-num-in-group                               | value    | ignored           | cpu-offload-params
OffloadConfig           | --offload-prefetch-step                              | value    | ignored           | cpu-offload-params
OffloadConfig           | --offload-params                                     | list     | ignored           | cpu-offload-params
MultiModalConfig        | --language-model-only                                | bool     | ignored           | text-only
MultiModalConfig        | --limit-mm-per-prompt                                | value    | ignored           | text-only
MultiModalConfig        | --enable-mm-embeds                                   | bool     | ignored           | text-only
MultiModalConfig        | --media-io-kwargs                                    | value    | ignored           | text-only
MultiModalConfig        | --mm-processor-kwargs                                | value    | ignored           | text-only
MultiModalConfig        | --mm-processor-cache-gb                              | value    | ignored           | text-only
MultiModalConfig        | --mm-processor-cache-type                            | value    | ignored           | text-only
MultiModalConfig        | --mm-hasher-algorithm                                | value    | ignored           | text-only
MultiModalConfig        | --mm-shm-cache-max-object-size-mb                    | value    | ignored           | text-only
MultiModalConfig        | --mm-encoder-only                                    | bool     | ignored           | text-only
MultiModalConfig        | --mm-encoder-tp-mode                                 | value    | ignored           | text-only
MultiModalConfig        | --mm-encoder-attn-backend                            | value    | ignored           | text-only
MultiModalConfig        | --mm-encoder-attn-dtype                              | value    | ignored           | text-only
MultiModalConfig        | --mm-encoder-fp8-scale-path                          | value    | ignored           | text-only
MultiModalConfig        | --mm-encoder-fp8-scale-save-path                     | value    | ignored           | text-only
MultiModalConfig        | --mm-encoder-fp8-scale-save-margin                   | value    | ignored           | text-only
MultiModalConfig        | --interleave-mm-strings                              | bool     | ignored           | text-only
MultiModalConfig        | --skip-mm-profiling                                  | bool     | ignored           | text-only
MultiModalConfig        | --video-pruning-rate                                 | value    | ignored           | text-only
MultiModalConfig        | --video-pruning-method                               | value    | ignored           | text-only
MultiModalConfig        | --mm-tensor-ipc                                      | value    | ignored           | text-only
MultiModalConfig        | --mm-processor-device                                | value    | ignored           | text-only
MultiModalConfig        | --mm-ipc-gpu-memory-gb                               | value    | ignored           | text-only
MultiModalConfig        | --mm-device-do-normalize                             | bool     | ignored           | text-only
LoRAConfig              | --enable-lora                                        | bool     | supported         |
LoRAConfig              | --max-loras                                          | value    | supported         |
LoRAConfig              | --max-lora-rank                                      | value    | supported         |
LoRAConfig              | --lora-dtype                                         | value    | only auto         | lora-dtype
LoRAConfig              | --enable-tower-connector-lora                        | bool     | ignored           | text-only
LoRAConfig              | --max-cpu-loras                                      | value    | supported         |
LoRAConfig              | --fully-sharded-loras                                | bool     | ignored           | fully-sharded-loras
LoRAConfig              | --lora-target-modules                                | list     | ignored           | lora-target-modules
LoRAConfig              | --default-mm-loras                                   | value    | ignored           | text-only
LoRAConfig              | --specialize-active-lora                             | bool     | ignored           | specialize-active-lora
LoRAConfig              | --enable-mixed-moe-lora-format                       | bool     | ignored           | moe
LoRAConfig              | --enable-moe-shared-loras                            | bool     | ignored           | moe
LoRAConfig              | --max-lora-cls-labels                                | value    | ignored           | max-lora-cls-labels
LoggingConfig           | --logging-config                                     | value    | refused           | logging-config
LoggingConfig           | --log-level                                          | value    | supported         |
LoggingConfig           | --log-config-file                                    | value    | supported         |
ObservabilityConfig     | --show-hidden-metrics-for-version                    | value    | ignored           | show-hidden-metrics-for-version
ObservabilityConfig     | --otlp-traces-endpoint                               | value    | refused           | otlp-traces-endpoint
ObservabilityConfig     | --collect-detailed-traces                            | list     | refused           | otlp-traces-endpoint
ObservabilityConfig     | --per-request-spec-decode-metrics                    | value    | only none         | per-request-spec-decode-metrics
ObservabilityConfig     | --kv-cache-metrics                                   | bool     | ignored           | kv-cache-metrics
ObservabilityConfig     | --kv-cache-metrics-sample                            | value    | ignored           | kv-cache-metrics
ObservabilityConfig     | --custom-histogram-buckets                           | value    | ignored           | custom-histogram-buckets
ObservabilityConfig     | --cudagraph-metrics                                  | bool     | ignored           | cuda
ObservabilityConfig     | --enable-layerwise-nvtx-tracing                      | bool     | ignored           | cuda
ObservabilityConfig     | --enable-mfu-metrics                                 | bool     | ignored           | enable-mfu-metrics
ObservabilityConfig     | --enable-logging-iteration-details                   | bool     | ignored           | enable-logging-iteration-details
ObservabilityConfig     | --jit-monitor-mode                                   | value    | ignored           | jit-monitor-mode
ObservabilityConfig     | --jit-monitor-verbose                                | bool     | ignored           | jit-monitor-mode
SchedulerConfig         | --max-num-batched-tokens                             | value    | supported         |
SchedulerConfig         | --max-num-scheduled-tokens                           | value    | refused           | max-num-scheduled-tokens
SchedulerConfig         | --max-num-seqs                                       | value    | supported         |
SchedulerConfig         | --max-num-active-seqs                                | value    | refused           | max-num-active-seqs
SchedulerConfig         | --max-num-queued-reqs                                | value    | supported         |
SchedulerConfig         | --max-num-queued-tokens                              | value    | refused           | max-num-queued-tokens
SchedulerConfig         | --long-prefill-token-threshold                       | value    | supported         |
SchedulerConfig         | --long-prefill-token-threshold-adaptive              | bool     | ignored           | long-prefill-token-threshold-adaptive
SchedulerConfig         | --scheduling-policy                                  | value    | supported         |
SchedulerConfig         | --enable-chunked-prefill                             | bool     | supported         |
SchedulerConfig         | --disable-chunked-mm-input                           | bool     | ignored           | text-only
SchedulerConfig         | --scheduler-cls                                      | value    | refused           | code
SchedulerConfig         | --scheduler-reserve-full-isl                         | bool     | ignored           | scheduler-reserve-full-isl
SchedulerConfig         | --watermark                                          | value    | ignored           | watermark
SchedulerConfig         | --prefill-schedule-interval                          | value    | ignored           | prefill-schedule-interval
SchedulerConfig         | --disable-hybrid-kv-cache-manager                    | bool     | supported         |
SchedulerConfig         | --async-scheduling                                   | bool     | ignored           | async-scheduling
SchedulerConfig         | --stream-interval                                    | value    | supported         |
CompilationConfig       | --cudagraph-capture-sizes                            | list     | ignored           | cudagraph-capture-sizes
CompilationConfig       | --max-cudagraph-capture-size                         | value    | ignored           | cudagraph-capture-sizes
KernelConfig            | --ir-op-priority                                     | value    | ignored           | ir-op-priority
KernelConfig            | --enable-flashinfer-autotune                         | bool     | ignored           | cuda
KernelConfig            | --moe-backend                                        | value    | ignored           | moe
KernelConfig            | --linear-backend                                     | value    | ignored           | ir-op-priority
KernelConfig            | --sparse-indexer-topk-backend                        | value    | ignored           | sparse-indexer-topk-backend
VllmConfig              | --speculative-config -sc                             | value    | supported         |
VllmConfig              | --spec-method                                        | value    | supported         |
VllmConfig              | --spec-model                                         | value    | supported         |
VllmConfig              | --spec-tokens                                        | value    | supported         |
VllmConfig              | --watermark-config                                   | value    | refused           | watermark-config
VllmConfig              | --diffusion-config -dc                               | value    | refused           | diffusion-config
VllmConfig              | --kv-transfer-config                                 | value    | refused           | kv-transfer-config
VllmConfig              | --kv-events-config                                   | value    | supported         |
VllmConfig              | --ec-transfer-config                                 | value    | refused           | ec-transfer-config
VllmConfig              | --ec-manager-config                                  | value    | ignored           | text-only
VllmConfig              | --compilation-config -cc                             | value    | ignored           | compilation-config
VllmConfig              | --attention-config -ac                               | value    | ignored           | attention-config
VllmConfig              | --engram-config                                      | value    | refused           | engram-config
VllmConfig              | --reasoning-config                                   | value    | ignored           | reasoning-config
VllmConfig              | --kernel-config                                      | value    | ignored           | ir-op-priority
VllmConfig              | --additional-config                                  | value    | ignored           | additional-config
VllmConfig              | --structured-outputs-config                          | value    | supported         |
VllmConfig              | --aux-output-config                                  | value    | ignored           | aux-output-config
VllmConfig              | --profiler-config                                    | value    | ignored           | profiler-config
VllmConfig              | --optimization-level                                 | value    | ignored           | compilation-config
VllmConfig              | --performance-mode                                   | value    | ignored           | performance-mode
VllmConfig              | --weight-transfer-config                             | value    | refused           | weight-transfer-config
"""
