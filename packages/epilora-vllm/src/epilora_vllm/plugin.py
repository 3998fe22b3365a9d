"""The `vllm.general_plugins` entry point: `register()` puts epilora's LoRA layer classes ahead
of vLLM's.

vLLM calls it in every process it starts (the API server, the engine core, each worker), before
the worker loads the model. It is idempotent, touches no GPU, and does nothing when
EPILORA_VLLM_DISABLE=1, when VLLM_PLUGINS leaves out `epilora` (vLLM then never calls it), or
on a vLLM it was not written for (logged). vLLM has no registration API for LoRA layer classes:
`vllm.lora.utils.from_layer` walks the module-level tuple `_all_lora_classes` at call time and
takes the first class whose `can_replace_layer` accepts the layer, so ours go first and decline
what the kernels cannot serve. The LM head's LoRA class is built by name
(`vllm.lora.model_manager` calls its module-level `from_layer_logits_processor`), so that name is
pointed at ours (`epilora_vllm.logits`: vLLM's class, without its kernels while no adapter has
lm_head weights). The matched mode's FP8 kernel goes first in vLLM's FP8 kernel lists
(`epilora_vllm.matched_linear`: it declines unless EPILORA_VLLM_MATCHED=1). Each adapter is
checked before vLLM's front end takes it, in a request or a load (`epilora_vllm.request_check`
wraps three of vLLM's methods).
"""

import logging

from epilora_vllm import _compat, _env

logger = logging.getLogger("vllm.epilora_vllm")


def register() -> bool:
    """Install the plugin in this process; True if its layers are (now or already) installed."""
    if _env.disabled():
        logger.info("epilora: EPILORA_VLLM_DISABLE=1, every layer stays vLLM's")
        return False
    why = _compat.check_version()
    if why is not None:
        logger.warning("epilora: not installed: %s", why)
        return False
    import vllm.lora.model_manager as model_manager
    import vllm.lora.utils as lora_utils

    import epilora_vllm.ops  # noqa: F401  (registers the torch.ops.epilora_vllm ops)
    from epilora_vllm import logits, matched_linear, request_check
    from epilora_vllm.layers import LAYER_CLASSES

    if installed():
        return True
    rest = tuple(cls for cls in lora_utils._all_lora_classes if cls not in LAYER_CLASSES)
    lora_utils._all_lora_classes = (*LAYER_CLASSES, *rest)
    model_manager.from_layer_logits_processor = logits.from_layer_logits_processor
    matched_linear.install()
    request_check.install()
    logger.info("epilora: LoRA layers on FP8 bases served by epilora-kernels "
                "(EPILORA_VLLM_DISABLE=1 turns this off)")
    return True


def installed() -> bool:
    """Whether this process's vLLM picks epilora's layer classes first (and its LM head's, and
    the matched mode's FP8 kernel) and checks each adapter before taking it."""
    import vllm.lora.model_manager as model_manager
    import vllm.lora.utils as lora_utils

    from epilora_vllm import logits, matched_linear, request_check
    from epilora_vllm.layers import LAYER_CLASSES

    return (lora_utils._all_lora_classes[: len(LAYER_CLASSES)] == LAYER_CLASSES
            and model_manager.from_layer_logits_processor is logits.from_layer_logits_processor
            and matched_linear.installed() and request_check.installed())
