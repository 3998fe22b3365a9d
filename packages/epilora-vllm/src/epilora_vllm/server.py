"""The plugin's part of vLLM's OpenAI server: a `vllm.endpoint_plugins` entry point
(`epilora-server`) that puts both of the plugin's server middlewares on the app vLLM builds.

vLLM 0.26 loads an endpoint plugin in the API server's process only, and only when it is named
in `VLLM_PLUGINS` (it widens the server's HTTP surface, so vLLM never loads one by default). That
variable is also the allowlist of every other plugin, so name the plugin's layers too, and
vLLM's own plugins the server uses (its LoRA resolvers are plugins: with
VLLM_LORA_RESOLVER_CACHE_DIR, `lora_filesystem_resolver`; this plugin warns when it is left out):

    VLLM_PLUGINS=epilora,epilora-server vllm serve ... --enable-lora

which is the same server as `--middleware epilora_vllm.adapter_check.refuse_bad_adapters
--middleware epilora_vllm.reload_guard.hold_reloads_until_drained`, but for one difference:
vLLM adds its own middlewares (CORS, the API key's check) after its endpoint plugins' and
before its `--middleware` ones, and the one added last runs first, so here the key is checked
before either of ours runs (named by `--middleware` they run before it: `refuse_bad_adapters`
checks the key itself there, and the reload guard may hold a load that vLLM then answers 401).
Adds no route. EPILORA_VLLM_DISABLE does not turn it off (the guard holds reloads that kill
stock vLLM's engine too): leaving it out of VLLM_PLUGINS does.
"""

import logging

logger = logging.getLogger("vllm.epilora_vllm")


class ServerPlugin:
    """vLLM's `EndpointPlugin` protocol (vllm/plugins/endpoint_plugins/interface.py)."""

    name = "epilora-server"
    # the servers that generate (a pooling model's server with adapters keeps `--middleware`)
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        """Called once by vLLM's `build_app`, before the app starts."""
        from epilora_vllm.adapter_check import refuse_bad_adapters
        from epilora_vllm.reload_guard import hold_reloads_until_drained

        # In `--middleware`'s order: the one added last runs first, so a reload held until
        # its name's requests are done is checked once it goes on.
        app.middleware("http")(refuse_bad_adapters)
        app.middleware("http")(hold_reloads_until_drained)
        logger.info("epilora: the server refuses bad adapters (HTTP 400) and holds a reload "
                    "until its name's requests are done")
        _warn_if_the_resolver_is_left_out()

    async def init_state(self, engine_client, state, args) -> None:
        """Nothing to keep: both middlewares read vLLM's own app state per request."""


def _warn_if_the_resolver_is_left_out() -> None:
    # Naming this plugin in VLLM_PLUGINS turns every plugin it does not name off, vLLM's own
    # filesystem LoRA resolver included: its cache folder set, no adapter would resolve.
    import vllm.envs as envs

    if (envs.VLLM_LORA_RESOLVER_CACHE_DIR and envs.VLLM_PLUGINS is not None
            and "lora_filesystem_resolver" not in envs.VLLM_PLUGINS):
        logger.warning("epilora: VLLM_LORA_RESOLVER_CACHE_DIR is set but VLLM_PLUGINS (%s) "
                       "leaves out vLLM's lora_filesystem_resolver: no adapter will be "
                       "resolved from that folder", ",".join(envs.VLLM_PLUGINS))
