"""Every adapter is checked before vLLM takes it, so that a bad one is refused with its reason
whatever brought it in: `LLM.generate` from Python, a server with or without the plugin's
middlewares, an adapter loaded at the server's start, at runtime or by a LoRA resolver (what is
not checked: below).

vLLM has no extension point for a check of its own there, so `install` wraps three of its
methods, each with vLLM's own code unchanged after `adapter_check.check_adapter_once`:

* `InputProcessor._validate_lora`, the front end's validation of each request's `LoRARequest`
  (in the process that takes the requests, before the engine core sees them): a `ValueError`
  there (`BadAdapter` is one) is the request's error: `LLM` raises it and takes back the
  batch's requests it had already added, and vLLM's OpenAI server answers it with HTTP 400
  (a streamed request: 200, then vLLM's error event with code 400 in the stream).
* `AsyncLLM.add_lora` (the server's `--lora-modules` at its start, `/v1/load_lora_adapter`,
  LoRA resolvers) and `LLMEngine.add_lora` (`LLM.llm_engine.add_lora` from Python): the
  adapter is refused before the engine core loads it, so its name is never served; vLLM's
  server then fails to start (a `--lora-modules` adapter) or answers the load with its 500
  and the reason (the middleware `refuse_bad_adapters` answers 400 before it), and a
  resolver's request with 400. The server's check reads the weights off the event loop.

The check reads an adapter's weights once per version of its files: a request after a checked
load reads only the files' metadata. Not checked (vLLM's own checks): hub ids and other paths
that are not local directories, `.bin`/`.pt` weights, tensorizer adapters, and requests given
to the engine already processed (vLLM's deprecated `EngineCoreRequest` input). Without it, vLLM
loads an adapter only when a batch first needs it, in the worker: a NaN or Inf in its weights
is served (its tenant's answers are NaN), and a file vLLM's loader cannot read fails the
engine's step that needed it, with the batch's other requests.
"""

import asyncio
import functools
import inspect

_MARK = "_epilora_checks_adapters"


def _check(vllm_config, lora_request) -> None:
    # A tensorizer adapter's weights are not in its lora_path: vLLM's to read.
    if (lora_request is not None and vllm_config.lora_config is not None
            and not getattr(lora_request, "tensorizer_config_dict", None)):
        from epilora_vllm.adapter_check import check_adapter_once

        check_adapter_once(lora_request.lora_path, vllm_config.model_config.hf_config,
                           vllm_config.lora_config.max_lora_rank)


def _targets():
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine

    return ((InputProcessor, "_validate_lora"), (AsyncLLM, "add_lora"),
            (LLMEngine, "add_lora"))


def _checked(vllms, is_async: bool):
    if is_async:
        async def checked(self, lora_request, *args, **kwargs):
            await asyncio.to_thread(_check, self.vllm_config, lora_request)
            return await vllms(self, lora_request, *args, **kwargs)
    else:
        def checked(self, lora_request, *args, **kwargs):
            _check(self.vllm_config, lora_request)
            return vllms(self, lora_request, *args, **kwargs)
    checked = functools.wraps(vllms)(checked)  # vLLM's name and doc; __wrapped__ is vLLM's
    setattr(checked, _MARK, True)
    return checked


def install() -> None:
    """Check each adapter before vLLM's front end takes it (idempotent)."""
    for cls, name in _targets():
        vllms = getattr(cls, name)
        if not getattr(vllms, _MARK, False):
            setattr(cls, name, _checked(vllms, inspect.iscoroutinefunction(vllms)))


def installed() -> bool:
    """Whether this process's vLLM checks each adapter before taking it."""
    return all(getattr(getattr(cls, name), _MARK, False) for cls, name in _targets())
