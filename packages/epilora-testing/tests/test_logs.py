"""epilora_testing.logs.heard: what one logger says inside the block, at its level or above,
on a logger that does not propagate."""

import logging

from epilora_testing.logs import heard


def test_heard_keeps_the_blocks_messages_of_its_level_on_a_logger_that_does_not_propagate():
    logger = logging.getLogger("epilora-testing.logs-test")
    logger.propagate = False
    logger.warning("before")
    with heard(logger.name) as said:
        logger.info("too low")
        logger.warning("one %d", 1)
        logger.error("two")
    logger.warning("after")
    assert said == ["one 1", "two"]
    assert logger.handlers == []
