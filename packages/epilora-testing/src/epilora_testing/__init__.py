"""epilora-testing: the shared test kit of the EpiLoRA packages.

`assert_bitwise_equal` (integer-view comparison with hex reports), hypothesis strategies
(`strategies`), named special-value corpora (`corpora`), vLLM oracles (`vllm_oracles`, imported
on use), the result files' text (`results`), what a non-propagating logger said (`logs`) and
a pytest plugin (`pytest_plugin`, loaded through the `pytest11` entry point).
"""

from epilora_testing.assertions import assert_bitwise_equal, bits, bitwise_mismatches

__all__ = ["assert_bitwise_equal", "bits", "bitwise_mismatches"]


def __getattr__(name: str):
    if name == "__version__":  # the version lives in pyproject.toml only
        from importlib.metadata import version

        return version("epilora-testing")
    raise AttributeError(f"module 'epilora_testing' has no attribute {name!r}")
