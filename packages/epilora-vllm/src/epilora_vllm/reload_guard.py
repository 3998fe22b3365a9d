"""Reloading an adapter under load without killing vLLM 0.26's engine: a server middleware
(`vllm serve ... --middleware epilora_vllm.reload_guard.hold_reloads_until_drained`).

Why: `/v1/unload_lora_adapter` forgets a name, and loading it again gives the adapter a new
integer id while requests admitted under the old id may still be running. A batch holding both
then names two ids for one adapter name, and vLLM collects the batch's `LoRARequest`s in a set,
where they are equal (LoRARequest compares and hashes by name alone): only one id is loaded
into a slot, the batch's mapping still names the other, and the worker dies of a `KeyError` in
`convert_mapping` (both model runners, `InputBatch.make_lora_inputs` and
`LoraState.get_activate_loras`; with or without this plugin).

What: this middleware counts, per name a request body's `model` gives other than the base
model's, the requests whose responses are still open (served by the server when the request
arrives or not: with runtime loading on, vLLM serves a request for a name whose load is in
flight under the new id once the load is done, and a name nobody loads gets vLLM's 404 at once),
and holds a `POST /v1/load_lora_adapter` of a name the server does not serve now (unloaded, or
never loaded; in place or not: vLLM gives such a name a new id either way) until that name's
count is zero, so the new id never meets the old one in a batch. Loads and unloads of one name
go one at a time through it. Where LoRA resolvers are registered (they load a requested name the
server does not serve, inside the request, with a new id), an unload also waits until the name's
requests are done (requests for the name wait behind it: one counted before it could otherwise
reach vLLM's handler after it and be resolved), and a request for a name not served is held as a
load is, then counted once the resolver has loaded the name. The reload waits as long as the old
requests run; without resolvers, requests for the name sent between the unload and the reload
get vLLM's 404 as before. Not covered: several API server processes (each counts its own
requests; it says so in the log at its first load or unload), SageMaker's routes (`/adapters`,
and `/invocations` naming the adapter in a header), requests whose body is not JSON
(transcriptions' forms), and a request the engine still runs for a step after its client went
away (vLLM aborts it asynchronously). The middleware runs before vLLM's API-key check: an
unauthenticated load or unload of a name is held like any other before it gets its 401.
"""

import asyncio
import logging
import weakref
from collections import Counter

from epilora_vllm.adapter_check import request_json

logger = logging.getLogger("vllm.epilora_vllm")  # a child of vLLM's logger: its handlers, format

_open: Counter = Counter()  # served adapter name -> responses still open
# name -> its loads and unloads, one at a time; a lock lives while someone holds or awaits it
# (names come from request bodies, unauthenticated ones too: no lock kept per name ever seen).
_locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_POLL_S = 0.05  # a held load looks at its name's count this often
_warned: list = []  # whether this process said that it counts only its own requests


def _warn_if_one_of_several_servers(request) -> None:
    # Each API server process (`--api-server-count` > 1) counts only the requests it serves.
    servers = getattr(getattr(request.app.state, "args", None), "api_server_count", None)
    if isinstance(servers, int) and servers > 1 and not _warned:
        _warned.append(True)
        logger.warning(
            "epilora reload_guard: this is one of %d API server processes and counts only its "
            "own requests: a name unloaded and loaded again while another process still "
            "streams its responses can still kill vLLM 0.26's engine; with one API server "
            "process, or without reloads under load, it cannot", servers)


def _models(request):
    # vLLM's registry of the served model and adapters (OpenAIServingModels), if any.
    return getattr(request.app.state, "openai_serving_models", None)


def _served(request, name: str) -> bool:
    # Whether vLLM's server knows the name now (its registry of adapters loaded by name).
    return name in getattr(_models(request), "lora_requests", {})


def _resolvers(request) -> bool:
    # Whether LoRA resolvers are registered: they load a requested name the server does not
    # serve inside the request, with a new id.
    return bool(getattr(_models(request), "lora_resolvers", None))


def _is_base_model(request, name: str) -> bool:
    is_base = getattr(_models(request), "is_base_model", None)
    return is_base is not None and is_base(name)


async def _drained(name: str) -> None:
    # Until no response of a request for `name` is open.
    while _open[name] > 0:
        await asyncio.sleep(_POLL_S)


def _lock(name: str) -> asyncio.Lock:
    lock = _locks.get(name)
    if lock is None:
        lock = _locks[name] = asyncio.Lock()
    return lock


def _release(name: str) -> None:
    _open[name] -= 1
    if _open[name] <= 0:
        del _open[name]


async def _counted(response, name: str):
    # The response of a request already counted under `name` (awaited here), its body wrapped
    # to release the count; released at once if no response comes.
    try:
        response = await response
    except BaseException:
        _release(name)
        raise
    response.body_iterator = _Counted(response.body_iterator, name)
    return response


class _Counted:
    """A response's body that releases its name's count once: when it ends, fails, is closed,
    or is dropped unread (the client went away before the first chunk)."""

    def __init__(self, body, name: str):
        self._body = body.__aiter__()
        self._done = weakref.finalize(self, _release, name)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self._body.__anext__()
        except BaseException:  # StopAsyncIteration included
            self._done()
            raise

    async def aclose(self) -> None:
        self._done()
        close = getattr(self._body, "aclose", None)
        if close is not None:
            await close()


async def hold_reloads_until_drained(request, call_next):
    """vLLM server middleware: a load of an adapter name the server does not serve now waits
    until no response of a request for that name is open; requests (a POST whose JSON body
    names a `model` other than the base model) are counted per name. With LoRA resolvers
    registered, an unload waits too, and so does a request for a name a resolver would load."""
    if request.method != "POST":
        return await call_next(request)
    body, path = await request_json(request), request.url.path
    if path.endswith(("/v1/load_lora_adapter", "/v1/unload_lora_adapter")):
        name = body.get("lora_name")
        if not isinstance(name, str):
            return await call_next(request)
        _warn_if_one_of_several_servers(request)
        async with _lock(name):
            if path.endswith("/v1/load_lora_adapter") and not _served(request, name):
                await _drained(name)
            elif path.endswith("/v1/unload_lora_adapter") and _resolvers(request):
                # A request counted under the name may reach vLLM's handler only after the
                # unload, and a resolver would load the name in it with a new id beside the
                # old requests: drained first (new requests for it wait on the lock).
                await _drained(name)
            return await call_next(request)
    name = body.get("model")
    if not isinstance(name, str):
        return await call_next(request)
    if _resolvers(request) and not _is_base_model(request, name):
        resolving = None
        async with _lock(name):  # past an unload of the name that is draining it
            if not _served(request, name):
                # A resolver may load the name inside this request, with a new id: held as a
                # load through the route is; the name's lock then held until the resolver has
                # loaded it (counted from there) or the request is over without it, not
                # through the whole generation.
                await _drained(name)
                resolving = asyncio.ensure_future(call_next(request))
                try:
                    while not resolving.done() and not _served(request, name):
                        await asyncio.sleep(_POLL_S)
                except BaseException:
                    resolving.cancel()
                    raise
                counted = _served(request, name)
                if counted:
                    _open[name] += 1
        if resolving is not None:
            # Not counted: no resolver found the name (vLLM's 404).
            return await (_counted(resolving, name) if counted else resolving)
    if _is_base_model(request, name):
        return await call_next(request)
    # Counted whether the name is served now or not: a request sent while its name's load is
    # in flight waits in vLLM's handler for that load and is then served under the new id
    # (vLLM's `_check_model`, with runtime loading on); uncounted, a reload after it would not
    # wait for it.
    _open[name] += 1  # no await since the check: an unload taking the lock now waits for it
    return await _counted(call_next(request), name)
