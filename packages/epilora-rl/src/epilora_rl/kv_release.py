"""Release the engine's KV cache while the trainer runs, keeping the shared weights on the GPU.

vLLM 0.26's sleep level 1 offloads the weights pool to host memory, so the trainer, which
computes on those very tensors, would read unmapped memory; level 2 discards them. This is a
sleep-mode backend (vLLM's extension point, `SleepModeBackendFactory`) that releases only the
allocations tagged `kv_cache` and maps them back on wake (their contents discarded: vLLM clears
the prefix cache when it sleeps). An engine started with `enable_sleep_mode=True` whose worker's
model config names BACKEND as its `sleep_mode_backend` (vLLM 0.26's EngineArgs do not take it:
`epilora_rl.engine.make_engine` sets it) then frees its KV cache with `llm.sleep()` and gets it
back with `llm.wake_up()`; the weights, the LoRA buffers and the CUDA graphs stay. CUDA only
(cumem).
"""

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend, SleepModeBackendFactory

BACKEND = "epilora-kv-only"
KV_TAG = "kv_cache"


class KvOnlySleepBackend(SleepModeBackend):
    def suspend(self, level: int = 1) -> None:
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

        self._state = "SUSPENDED"
        for data in CuMemAllocator.get_instance().pointer_to_data.values():
            if data.tag == KV_TAG and not data.is_asleep:
                unmap_and_release(data.handle)
                data.is_asleep = True

    def resume(self, tags: list[str] | None = None) -> None:
        from vllm.device_allocator.cumem import CuMemAllocator, create_and_map

        self._state = "RESUMING"
        if tags is None or KV_TAG in tags:
            for data in CuMemAllocator.get_instance().pointer_to_data.values():
                if data.tag == KV_TAG and data.is_asleep:
                    create_and_map(data.handle)
                    data.is_asleep = False
        self._state = "RUNNING"

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # NCCL's buffers are not in the pool

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        return True  # nothing but the KV cache is touched


def register() -> str:
    """Register the backend with vLLM (once per process); returns its name."""
    if BACKEND not in SleepModeBackendFactory._registry:
        SleepModeBackendFactory.register_backend(BACKEND, __name__, "KvOnlySleepBackend")
    return BACKEND
