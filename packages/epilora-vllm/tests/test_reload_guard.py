"""epilora_vllm.reload_guard without vLLM's server: the middleware on a FastAPI app that stands
in for vLLM's (its registry of served names, a generation route whose responses stay open
until the test lets them end, and the load and unload routes). The end to end case, vLLM's
engine under unloads and reloads, is test_server_cpu.py's."""

import asyncio
import weakref
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from epilora_testing.logs import heard
from epilora_vllm import reload_guard


@pytest.fixture(autouse=True)
def _fresh_guard(monkeypatch):
    # Each test's event loop its own locks (an asyncio lock a loop waited on is bound to it)
    # and counts; a server has one loop for its life.
    monkeypatch.setattr(reload_guard, "_locks", weakref.WeakValueDictionary())
    monkeypatch.setattr(reload_guard, "_open", Counter())


def _app(served: set[str], gate: asyncio.Event, gate_404: asyncio.Event,
         resolves: set[str] | None = None) -> FastAPI:
    # `resolves`: a LoRA resolver registered, which loads these names inside a request for
    # them (vLLM's resolve_lora, in the request's handler: inside the guard).
    app = FastAPI()
    app.state.openai_serving_models = SimpleNamespace(lora_requests=dict.fromkeys(served, 1))
    registry = app.state.openai_serving_models.lora_requests

    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await request.json()
        found = body.get("model") in registry
        if body.get("stream") is False and found:  # the whole answer before any byte of it
            await gate.wait()
            return JSONResponse({"text": "done"})

        async def tokens():  # each response open until the test lets it end
            await (gate if found else gate_404).wait()
            yield b"data: done\n\n" if found else b"not found"

        return StreamingResponse(tokens(), status_code=200 if found else 404)

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        registry[(await request.json())["lora_name"]] = 1
        return JSONResponse({"loaded": True})

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        registry.pop((await request.json())["lora_name"], None)
        return JSONResponse({"unloaded": True})

    if resolves is not None:
        app.state.openai_serving_models.lora_resolvers = ["a stand-in resolver"]
        app.state.openai_serving_models.is_base_model = lambda name: name == "base"

        @app.middleware("http")
        async def resolve(request, call_next):
            if request.url.path == "/v1/completions":
                name = (await request.json()).get("model")
                if name in resolves:
                    registry.setdefault(name, 2)
            return await call_next(request)

    app.middleware("http")(reload_guard.hold_reloads_until_drained)  # added last: outermost
    return app


def test_a_reload_waits_for_the_old_requests_in_place_or_not_and_others_do_not():
    async def scenario():
        gate, gate_404 = asyncio.Event(), asyncio.Event()
        app = _app({"a", "b"}, gate, gate_404)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            def post(path, **body):
                return asyncio.create_task(client.post(path, json=body))

            running = [post("/v1/completions", model="a"), post("/v1/completions", model="a")]
            await asyncio.sleep(0.1)
            assert reload_guard._open["a"] == 2
            assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
                    ).status_code == 200
            late = post("/v1/completions", model="a")  # unloaded: a 404, counted till it ends
            await asyncio.sleep(0.1)
            assert not late.done() and reload_guard._open["a"] == 3
            # In place first: held by the guard, not merely queued behind the other reload.
            reloads = [post("/v1/load_lora_adapter", lora_name="a", lora_path="p",
                            load_inplace=True)]
            await asyncio.sleep(0.1)
            assert not reloads[0].done()
            reloads.append(post("/v1/load_lora_adapter", lora_name="a", lora_path="p"))
            served = post("/v1/load_lora_adapter", lora_name="b", lora_path="p")  # not held
            other = post("/v1/load_lora_adapter", lora_name="c", lora_path="p")  # none open
            await asyncio.sleep(0.3)
            assert served.done() and other.done()
            assert not any(task.done() for task in reloads)  # held while a's requests run
            gate.set()
            assert [r.status_code for r in await asyncio.wait_for(asyncio.gather(*running), 10)
                    ] == [200] * 2
            await asyncio.sleep(0.3)
            assert not any(task.done() for task in reloads)  # and while the 404 is open
            gate_404.set()
            assert (await asyncio.wait_for(late, 10)).status_code == 404
            done = await asyncio.wait_for(asyncio.gather(*reloads), 10)
            assert [response.status_code for response in done] == [200] * 2
            assert not reload_guard._open

    asyncio.run(scenario())


def test_a_request_sent_while_its_names_load_is_in_flight_is_counted(monkeypatch):
    # On vLLM's own registry (OpenAIServingModels) and model check (`_check_model`), the engine
    # a stand-in whose load the test holds: with runtime loading on, a request for a name whose
    # load is in flight waits in vLLM's handler for that load (`resolve_lora` takes the lock
    # the load holds) and is then served under the new id. The guard counts it, so that after
    # an unload the next load of the name waits until its answer is done.
    from vllm import envs
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.engine.serving import BaseServing
    from vllm.entrypoints.serve.lora.protocol import (
        LoadLoRAAdapterRequest,
        UnloadLoRAAdapterRequest,
    )

    # Set on the module itself: an engine started earlier in this process turns on vLLM's
    # cache of its environment variables, which the environment would not reach.
    monkeypatch.setattr(envs, "VLLM_ALLOW_RUNTIME_LORA_UPDATING", True, raising=False)

    async def scenario():
        loading, generating = asyncio.Event(), asyncio.Event()

        class Engine:
            model_config = SimpleNamespace(model="base", max_model_len=256)
            renderer = input_processor = None

            async def add_lora(self, lora_request):  # the engine core's load, held
                await loading.wait()
                return True

        models = OpenAIServingModels(Engine(), [BaseModelPath(name="base", model_path="base")])
        serving = object.__new__(BaseServing)
        serving.models = models
        app = FastAPI()
        app.state.openai_serving_models = models
        ids = []  # the adapter id each answer was made under

        @app.post("/v1/load_lora_adapter")
        async def load(body: LoadLoRAAdapterRequest):
            loaded = isinstance(await models.load_lora_adapter(body), str)
            return JSONResponse({}, status_code=200 if loaded else 400)

        @app.post("/v1/unload_lora_adapter")
        async def unload(body: UnloadLoRAAdapterRequest):
            unloaded = isinstance(await models.unload_lora_adapter(body), str)
            return JSONResponse({}, status_code=200 if unloaded else 400)

        @app.post("/v1/completions")
        async def complete(request: Request):
            name = (await request.json())["model"]
            if await serving._check_model(SimpleNamespace(model=name)) is not None:
                return JSONResponse({}, status_code=404)
            ids.append(models.lora_requests[name].lora_int_id)
            await generating.wait()
            return JSONResponse({})

        app.middleware("http")(reload_guard.hold_reloads_until_drained)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            def post(path, **body):
                return asyncio.create_task(client.post(path, json=body))

            first = post("/v1/load_lora_adapter", lora_name="a", lora_path="p")
            await asyncio.sleep(0.1)
            request = post("/v1/completions", model="a")
            await asyncio.sleep(0.1)
            assert not request.done() and not ids  # waiting in vLLM's handler for the load
            loading.set()
            assert (await asyncio.wait_for(first, 10)).status_code == 200
            await asyncio.sleep(0.1)
            assert len(ids) == 1 and reload_guard._open["a"] == 1  # served, and counted
            assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
                    ).status_code == 200
            reload = post("/v1/load_lora_adapter", lora_name="a", lora_path="p")
            await asyncio.sleep(0.3)
            assert not reload.done()  # held while the answer made under the old id runs
            generating.set()
            assert (await asyncio.wait_for(request, 10)).status_code == 200
            assert (await asyncio.wait_for(reload, 10)).status_code == 200
            assert not reload_guard._open

    asyncio.run(scenario())


def test_a_count_is_released_when_the_response_fails_or_is_dropped_unread():
    async def scenario():
        app = FastAPI()
        app.state.openai_serving_models = SimpleNamespace(lora_requests={"a": 1})

        @app.post("/v1/completions")
        async def broken(request: Request):
            raise RuntimeError("the handler failed")

        app.middleware("http")(reload_guard.hold_reloads_until_drained)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post("/v1/completions", json={"model": "a"})
        assert response.status_code == 500 and not reload_guard._open

        async def body():
            yield b"never read"

        reload_guard._open["a"] += 1
        counted = reload_guard._Counted(body(), "a")
        del counted  # a response dropped before its first chunk
        assert not reload_guard._open

    asyncio.run(scenario())


def test_one_of_several_api_servers_says_once_that_it_counts_only_its_own(monkeypatch):
    monkeypatch.setattr(reload_guard, "_warned", [])

    async def scenario(servers):
        app = _app(set(), asyncio.Event(), asyncio.Event())
        app.state.args = SimpleNamespace(api_server_count=servers)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for name in ("a", "b"):
                response = await client.post("/v1/load_lora_adapter",
                                              json={"lora_name": name, "lora_path": "p"})
                assert response.status_code == 200

    with heard("vllm.epilora_vllm") as said:  # caplog does not hear vLLM's loggers
        asyncio.run(scenario(1))
        assert not said
        asyncio.run(scenario(4))
    assert len(said) == 1 and "one of 4 API server processes" in said[0], said


def test_with_a_resolver_an_unload_drains_the_name_and_its_next_request_is_counted(
        monkeypatch):
    # With a LoRA resolver registered, a request for a name the server does not serve loads it
    # inside the request (vLLM: a new id). So an unload waits until the name's requests are
    # done, a request for the name waits behind it, and, the name unloaded, that request goes
    # on (the resolver loads the name) and is counted: three releases of "a", the two old
    # requests' and its own. The base model's requests and a name no resolver finds pass.
    released = []
    release = reload_guard._release
    monkeypatch.setattr(reload_guard, "_release",
                        lambda name: released.append(name) or release(name))

    async def scenario():
        gate, gate_404 = asyncio.Event(), asyncio.Event()
        app = _app({"a"}, gate, gate_404, resolves={"a"})
        registry = app.state.openai_serving_models.lora_requests
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            def post(path, **body):
                return asyncio.create_task(client.post(path, json=body))

            running = [post("/v1/completions", model="a") for _ in range(2)]
            await asyncio.sleep(0.1)
            assert reload_guard._open["a"] == 2
            unload = post("/v1/unload_lora_adapter", lora_name="a")
            await asyncio.sleep(0.1)
            following = post("/v1/completions", model="a")
            base = post("/v1/completions", model="base")
            unknown = post("/v1/completions", model="z")
            await asyncio.sleep(0.3)
            assert not unload.done() and not following.done() and "a" in registry
            assert reload_guard._open["a"] == 2  # the following request not counted yet
            gate_404.set()
            assert (await asyncio.wait_for(base, 10)).status_code == 404  # the stand-in's
            assert (await asyncio.wait_for(unknown, 10)).status_code == 404
            gate.set()
            done = await asyncio.wait_for(asyncio.gather(*running, unload, following), 10)
            assert [response.status_code for response in done] == [200] * 4
            assert registry["a"] == 2 and not reload_guard._open  # loaded by the resolver
            assert released == ["a"] * 3, released

    asyncio.run(scenario())


def test_a_resolved_names_lock_is_not_held_through_the_first_whole_answer():
    # Two requests for a name a resolver loads, each answered only once complete (as vLLM's
    # non-streaming completions): the first holds the name's lock only until the resolver has
    # loaded the name, so the second is counted while the first's answer is still being made.
    async def scenario():
        gate = asyncio.Event()
        app = _app(set(), gate, asyncio.Event(), resolves={"r"})
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            requests = [asyncio.create_task(client.post(
                "/v1/completions", json={"model": "r", "stream": False})) for _ in range(2)]
            await asyncio.sleep(0.3)
            assert not any(r.done() for r in requests) and reload_guard._open["r"] == 2
            gate.set()
            done = await asyncio.wait_for(asyncio.gather(*requests), 10)
            assert [r.status_code for r in done] == [200, 200] and not reload_guard._open

    asyncio.run(scenario())
