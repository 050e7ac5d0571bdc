"""The Ray Serve app's cache index (`entrypoints/ray_serve/cache_index.py`) over a fake replica
set, without Ray: replicas' KV events route a shared prefix to its holder, the load threshold
sends it elsewhere, and replicas that leave drop out of the index (late reports ignored)."""

import pytest

from pagedserve.engine.kv_events import BlockStored, KVEventBatch, encode_batch
from pagedserve.entrypoints.ray_serve.cache_index import CacheIndex

BS = 4
PREFIX = list(range(10, 22))  # three full blocks


def _stored(tokens, first_hash=100):
    """The msgpack batch of a replica that cached `tokens`' full blocks (one chain)."""
    n = len(tokens) // BS
    return encode_batch(KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=[first_hash + i for i in range(n)], parent_block_hash=None,
        token_ids=tokens[:n * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None)]))


def test_a_shared_prefix_goes_to_its_holder_until_the_holder_is_too_loaded():
    index = CacheIndex("prefix", BS, threshold=50)
    index.sync_replicas(["a", "b"])
    index.report("b", _stored(PREFIX + [1]), load=0)
    assert index.choose(PREFIX + [7, 8]) == "b"
    assert index.stats()["replicas"]["b"]["blocks"] == 3
    # a prompt sharing nothing: the least loaded replica (b's load grew by the routed prompt)
    assert index.choose([5, 6, 7, 8, 9]) == "a"
    # b's own report: too loaded (by more than the threshold): the least loaded takes it
    index.report("b", None, load=200)
    assert index.choose(PREFIX + [9]) == "a"
    assert index.stats()["overloaded"] == 1
    # Serve offers only some replicas (the others are full): among those
    index.report("b", None, load=0)
    assert index.choose(PREFIX + [9], candidates=["a"]) == "a"
    assert index.choose(PREFIX + [9], candidates=["a", "b"]) == "b"


def test_a_replica_that_leaves_drops_out_of_the_index():
    index = CacheIndex("prefix", BS)
    index.sync_replicas(["a", "b"])
    index.report("a", _stored(PREFIX + [1]), load=0)
    assert index.choose(PREFIX + [3]) == "a"
    index.sync_replicas(["b", "c"])  # a scaled down, c started
    assert set(index.replicas()) == {"b", "c"}
    assert index.router.index.match(PREFIX + [3]) == {}  # a's blocks left the index
    index.report("a", _stored(PREFIX + [1]), load=0)  # a late report of the gone replica
    assert "a" not in index.stats()["replicas"]
    assert index.choose(PREFIX + [3], candidates=["a", "b", "c"]) in ("b", "c")
    index.remove_replica("b")
    index.remove_replica("c")
    with pytest.raises(RuntimeError, match="no engine core is alive"):
        index.choose(PREFIX)


def test_round_robin_and_least_load_ignore_the_cache():
    rr = CacheIndex("round-robin", BS)
    rr.sync_replicas(["a", "b"])
    rr.report("a", _stored(PREFIX + [1]), load=0)
    assert [rr.choose(PREFIX + [i]) for i in range(4)] == ["a", "b", "a", "b"]
    ll = CacheIndex("least-load", BS)
    ll.sync_replicas(["a", "b"])
    ll.report("a", _stored(PREFIX + [1]), load=30)
    assert ll.choose(PREFIX + [2]) == "b"


def test_a_redeploy_reconfigures_the_routing():
    index = CacheIndex("prefix", BS)
    index.sync_replicas(["a", "b"])
    index.report("a", _stored(PREFIX + [1]), load=0)
    index.configure("round-robin", BS, 10)
    assert [index.choose(PREFIX + [i]) for i in range(2)] == ["a", "b"]
    index.configure("prefix", 2 * BS, 10)  # another block size: the old blocks mean nothing
    assert index.router.index.match(PREFIX + [3]) == {}
    with pytest.raises(ValueError, match="routing"):
        index.configure("random", BS, 10)
