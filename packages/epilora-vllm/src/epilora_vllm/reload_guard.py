"""Reloading an adapter under load without killing vLLM 0.26's engine: a server middleware
(`vllm serve ... --middleware epilora_vllm.reload_guard.hold_reloads_until_drained`).

Why: `/v1/unload_lora_adapter` forgets a name, and loading it again gives the adapter a new
integer id while requests admitted under the old id may still be running. A batch holding both
then names two ids for one adapter name, and vLLM collects the batch's `LoRARequest`s in a set,
where they are equal (LoRARequest compares and hashes by name alone): only one id is loaded
into a slot, the batch's mapping still names the other, and the worker dies of a `KeyError` in
`convert_mapping` (both model runners, `InputBatch.make_lora_inputs` and
`LoraState.get_activate_loras`; with or without this plugin).

What: this middleware counts, per adapter name (a request body's `model`), the generation
requests whose responses are still open, and holds a `POST /v1/load_lora_adapter` of a name
the server does not serve now (unloaded, or never loaded), unless in place, until that name's
count is zero, so the new id never meets the old one in a batch. The reload
waits as long as the old requests run; requests for the name sent between the unload and the
reload get vLLM's 404 as before. Not covered: several API server processes (each counts its
own requests), adapters that a LoRA resolver loads inside a generation request, and a request
the engine still runs for a step after its client went away (vLLM aborts it asynchronously).
"""

import asyncio
import json
from collections import Counter

_open: Counter = Counter()  # adapter or model name -> generation responses still open
_drained: asyncio.Condition | None = None  # made in the server's event loop, on first use


def _condition() -> asyncio.Condition:
    global _drained
    if _drained is None:
        _drained = asyncio.Condition()
    return _drained


async def _body(request) -> dict:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        return {}  # vLLM answers a malformed request itself
    return body if isinstance(body, dict) else {}


def _served(request, name: str) -> bool:
    # Whether vLLM's server knows the name now (its registry of adapters loaded by name): a
    # load of such a name keeps its id (in place) or is refused, and is not held.
    models = getattr(request.app.state, "openai_serving_models", None)
    return name in getattr(models, "lora_requests", {})


async def _release(name: str) -> None:
    condition = _condition()
    async with condition:
        _open[name] -= 1
        if _open[name] <= 0:
            del _open[name]
            condition.notify_all()


async def _counted(body, name: str):
    # The response's body, with the name's count released when it ends (finished, failed or
    # closed because the client went away).
    try:
        async for chunk in body:
            yield chunk
    finally:
        await _release(name)


async def hold_reloads_until_drained(request, call_next):
    """vLLM server middleware: a load of an adapter name the server does not serve now waits
    until no response of a request for that name is open; generation requests (a POST whose
    body names a `model`) are counted per name."""
    if request.method != "POST":
        return await call_next(request)
    body = await _body(request)
    if request.url.path.endswith("/v1/load_lora_adapter"):
        name = body.get("lora_name")
        if isinstance(name, str) and not body.get("load_inplace") and not _served(request, name):
            condition = _condition()
            async with condition:
                await condition.wait_for(lambda: _open[name] <= 0)
        return await call_next(request)
    name = body.get("model")
    if not isinstance(name, str) or request.url.path.endswith("/v1/unload_lora_adapter"):
        return await call_next(request)
    _open[name] += 1
    try:
        response = await call_next(request)
    except BaseException:
        await _release(name)
        raise
    response.body_iterator = _counted(response.body_iterator, name)
    return response
