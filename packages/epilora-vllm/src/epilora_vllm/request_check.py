"""Every request that names an adapter is checked before vLLM admits it, so that a bad adapter
is refused with its reason whatever brought it in: `LLM.generate` from Python, a server with
or without the plugin's middlewares, an adapter loaded at runtime or by a LoRA resolver.

vLLM validates each request's `LoRARequest` in its front end (`InputProcessor._validate_lora`,
in the process that takes the requests), before the request reaches the engine core; a
`ValueError` there is the request's error: `LLM` raises it and takes back the batch's requests
it had already added, and vLLM's OpenAI server answers it with HTTP 400 in its error format.
vLLM has no extension point for a check of its own there, so `install` wraps that method:
vLLM's check, then `adapter_check.check_adapter_once` (`BadAdapter` is a `ValueError`). The
adapter's weights are read once per version of its files, on the first request that names it
(on the event loop, in a server), or never where the server's middleware checked it at load.

Without it, vLLM loads an adapter only when a batch first needs it, in the worker: a NaN or Inf
in its weights is served (its tenant's answers are NaN), and a file vLLM's loader cannot read
fails the engine's step that needed it, with the batch's other requests.
"""

_MARK = "_epilora_checks_adapters"


def install() -> None:
    """Wrap vLLM's front-end LoRA validation with the adapter check (idempotent)."""
    from vllm.v1.engine.input_processor import InputProcessor

    if installed():
        return
    vllms = InputProcessor._validate_lora

    def _validate_lora(self, lora_request) -> None:
        vllms(self, lora_request)
        if lora_request is not None and self.lora_config is not None:
            from epilora_vllm.adapter_check import check_adapter_once

            check_adapter_once(lora_request.lora_path, self.model_config.hf_config,
                               self.lora_config.max_lora_rank)

    _validate_lora.__wrapped__ = vllms
    setattr(_validate_lora, _MARK, True)
    InputProcessor._validate_lora = _validate_lora


def installed() -> bool:
    """Whether this process's vLLM checks each request's adapter."""
    from vllm.v1.engine.input_processor import InputProcessor

    return getattr(InputProcessor._validate_lora, _MARK, False)
