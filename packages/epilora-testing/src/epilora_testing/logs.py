"""Log records heard on one logger, for loggers pytest's `caplog` does not hear: vLLM's
"vllm" logger does not propagate to the root once vLLM is imported, so the plugin's
"vllm.epilora_vllm" records never reach caplog's handler there."""

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def heard(logger_name: str, level: int = logging.WARNING) -> Iterator[list[str]]:
    """The messages of `level` or above logged on `logger_name` inside the block, in order."""
    said: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
