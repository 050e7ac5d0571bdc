"""KV cache events (vLLM's schema) from the prefix cache, and the data-parallel router's index
and policies built on them. Pure Python: no model, no process."""

import msgspec
import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.dp_router import PrefixIndex, Router
from pagedserve.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventCollector,
    KVEventsConfig,
    decode_batch,
    encode_batch,
    external_hash,
    offset_endpoint_port,
)


def _manager(num_blocks=8, bs=4, rank=0):
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True)
    kv.events = KVEventCollector(bs, rank, {7: "sql"})
    return kv


def _compute(kv, seq_id, tokens, salt=None):
    kv.allocate_slots(seq_id, len(tokens))
    kv.cache_full_blocks(seq_id, tokens, len(tokens), salt)


def test_stored_removed_cleared_events_follow_the_prefix_cache():
    kv = _manager(num_blocks=4)
    tokens = list(range(10, 20))  # 2 full blocks + 2 tokens
    _compute(kv, 0, tokens)
    batch = kv.events.take()
    assert batch.data_parallel_rank == 0
    [stored] = batch.events
    assert isinstance(stored, BlockStored)
    assert len(stored.block_hashes) == 2  # one chain: one event
    assert stored.parent_block_hash is None and stored.token_ids == tokens[:8]
    assert stored.block_size == 4 and stored.lora_id is None and stored.medium == "GPU"
    assert all(0 <= h < 2**64 for h in stored.block_hashes)
    assert kv.events.take() is None
    # a second sequence sharing the chain and extending it: only its new block is stored
    kv.free(0)
    blocks = kv.match_prefix(tokens + [1, 2, 3, 4, 5])
    kv.use_prefix(1, blocks)
    kv.allocate_slots(1, 15)
    kv.cache_full_blocks(1, tokens + [1, 2, 3, 4, 5], 15)
    [more] = kv.events.take().events
    assert more.parent_block_hash == stored.block_hashes[1] and more.token_ids == [18, 19, 1, 2]
    kv.free(1)
    # a new sequence needs the blocks back: the cached ones it takes are removed
    _compute(kv, 2, [7] * 9)
    removed = [e for e in kv.events.take().events if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) >= 1
    kv.free(2)
    assert kv.reset_prefix_cache()
    assert isinstance(kv.events.take().events[-1], AllBlocksCleared)


def test_adapter_and_salt_travel_with_the_stored_blocks():
    kv = _manager()
    _compute(kv, 0, list(range(9)), salt=("lora", 7, "s1"))
    [stored] = kv.events.take().events
    assert stored.lora_id == 7 and stored.lora_name == "sql"
    assert stored.extra_keys == [("s1",), ("s1",)]


def test_batches_are_vllms_msgpack_layout():
    kv = _manager()
    _compute(kv, 0, list(range(9)))
    batch = kv.events.take()
    payload = encode_batch(batch)
    # vLLM's EventBatch is array-like (ts, events, data_parallel_rank); each event a map tagged
    # with its class name under "type"; lora_name and medium are always present
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and raw[2] == 0
    event = raw[1][0]
    assert event["type"] == "BlockStored"
    assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
            "lora_name"} <= set(event)
    assert decode_batch(payload) == batch


def test_kv_events_config_is_vllms():
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert KVEventsConfig.parse({}).publisher == "null"
    with pytest.raises(ValueError, match="kv_events_config"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "bogus": 1}')
    with pytest.raises(ValueError, match="kv_events_config"):
        KVEventsConfig.parse("[1]")
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("inproc://x", 1) == "inproc://x_dp1"


def test_the_index_matches_prefixes_across_cores_whatever_their_hashes():
    # two cores hash differently (a per-process salt): the index keys blocks by their chains
    a, b = _manager(16, rank=0), _manager(16, rank=1)
    shared = list(range(100, 112))
    _compute(a, 0, shared + [1, 2, 3, 4, 9])
    _compute(b, 0, shared[:4] + [5, 5, 5, 5, 9])
    index = PrefixIndex(4)
    index.apply(0, a.events.take())
    index.apply(1, b.events.take())
    assert index.match(shared + [1, 2, 3, 4, 6, 6]) == {0: 4, 1: 1}
    assert index.match(shared[:4] + [5, 5, 5, 5, 0]) == {0: 1, 1: 2}
    assert index.match([9] * 12) == {}
    assert index.match(shared + [0], lora_id=7) == {}  # another adapter's chain
    # a reset on core 0, then a removal on core 1
    index.apply(0, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert index.match(shared + [0]) == {1: 1}
    index.apply(1, KVEventBatch(ts=0.0, events=[BlockRemoved(
        block_hashes=[external_hash(b._block_key[b.block_table(0)[0]][0])], medium="GPU")]))
    assert index.match(shared + [0]) == {}


def test_routing_policies():
    router = Router(2, "prefix", block_size=4, threshold=100)
    kv = _manager(16, rank=1)
    prompt = list(range(50, 70))
    _compute(kv, 0, prompt)
    router.apply_events(1, kv.events.take())
    router.add_load(1, 80)  # within the threshold: the prefix wins
    assert router.choose(prompt + [1]) == 1
    router.add_load(1, 35)  # 115 over the least loaded, but core 0 would compute 20 tokens more
    assert router.choose(prompt + [1]) == 1
    assert router.choose(prompt[:8] + [1]) == 0  # 115 - 8 > 100: the least loaded wins
    router.add_load(1, 15)  # 130 - 20 > 100: the least loaded wins
    assert router.choose(prompt + [1]) == 0
    router.add_load(0, 1000)
    router.add_load(1, 1000)  # 1130 over 1000 + 20 is past the threshold but within 1.5x
    assert router.choose(prompt + [1]) == 1
    router.add_load(1, 500)  # 1630 > 1.5 x 1020 and 610 > 100 past it: the least loaded
    assert router.choose(prompt + [1]) == 0
    router.add_load(0, -1000)
    router.add_load(1, -1500)
    assert router.choose([1, 2, 3]) == 0  # no hit: least loaded
    router.mark_dead(0)
    assert router.choose([1, 2, 3]) == 1
    router.mark_dead(1)
    with pytest.raises(RuntimeError, match="no engine core"):
        router.choose([1])
    rr = Router(3, "round-robin")
    assert [rr.choose([1]) for _ in range(4)] == [0, 1, 2, 0]
    ll = Router(2, "least-load")
    ll.add_load(0, 10)
    assert ll.choose([1]) == 1
    with pytest.raises(ValueError, match="data_parallel_routing"):
        Router(2, "random")


def test_an_adapter_prefers_the_core_that_served_it():
    router = Router(2, "prefix", threshold=1000)
    router.add_load(0, 5)
    assert router.choose([1, 2], lora_id=3) == 1  # least loaded first
    router.add_load(1, 50)
    assert router.choose([7, 8], lora_id=3) == 1  # it is loaded there: preferred
    assert router.choose([7, 8], lora_id=4) == 0  # another adapter: least loaded
