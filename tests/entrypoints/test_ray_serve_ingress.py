"""The Ray Serve ingress's engine client (`entrypoints/ray_serve/ingress.py`) over a fake Serve
handle, without a Ray cluster: a replica that dies before the request produced anything passes
it on to another replica unseen; one that dies after its first output ends it with a 503-class
`EngineDeadError` saying so; a replica's refusal is the engine's ValueError."""

import asyncio

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")

from pagedserve.engine.request_stream import EngineDeadError  # noqa: E402
from pagedserve.entrypoints.ray_serve.ingress import ServeEngineClient  # noqa: E402
from pagedserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402


def _out(request_id, tokens, finished):
    return RequestOutput(request_id, None, [1, 2, 3], None,
                         [CompletionOutput(0, "", list(tokens), None, None,
                                           "length" if finished else None)], finished)


class _FakeHandle:
    """`handle.options(stream=True).generate.remote(request)`: each call plays the next script
    (items, then "die" to raise the replica's death)."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)
        self.calls = []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        self.calls.append(request)
        script = self.scripts.pop(0)

        class _Call:
            def cancel(self):
                pass

            async def __aiter__(self):
                for item in script:
                    await asyncio.sleep(0)
                    if item == "die":
                        raise ray_exceptions.ActorDiedError()
                    yield item(request["request_id"]) if callable(item) else item

        return _Call()


@pytest.fixture(scope="module")
def info():
    return {"max_model_len": 64, "vocab_size": 512}


def _client(path, handle, info):
    return ServeEngineClient(handle, str(path), {"dtype": "float32"}, info)


async def _run(client):
    stream = await client.add_request("r1", None, SamplingParams(max_tokens=2),
                                      prompt_token_ids=[1, 2, 3])
    return [out async for out in stream]


def test_a_request_that_produced_nothing_moves_on_from_a_dead_replica(checkpoints, info):
    done = lambda rid: _out(rid, [7, 8], True)  # noqa: E731
    handle = _FakeHandle([("accepted",), "die"], [("accepted",), done])
    outs = asyncio.run(_run(_client(checkpoints("llama"), handle, info)))
    assert [o.outputs[0].token_ids for o in outs] == [[7, 8]] and outs[-1].finished
    assert len(handle.calls) == 2 and handle.calls[0] == handle.calls[1]


def test_a_request_that_produced_output_is_lost_with_its_replica(checkpoints, info):
    first = lambda rid: _out(rid, [7], False)  # noqa: E731
    handle = _FakeHandle([("accepted",), first, "die"])
    with pytest.raises(EngineDeadError, match="replica running the request died"):
        asyncio.run(_run(_client(checkpoints("llama"), handle, info)))
    assert len(handle.calls) == 1


def test_a_replicas_refusal_is_the_engines_value_error(checkpoints, info):
    handle = _FakeHandle([("error", "value", "priority=3: no")])
    with pytest.raises(ValueError, match="priority=3"):
        asyncio.run(_run(_client(checkpoints("llama"), handle, info)))
