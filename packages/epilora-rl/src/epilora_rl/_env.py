"""The environment variables epilora-rl reads, all here, read at call time."""

import os


def crash_point() -> tuple[str, int] | None:
    """EPILORA_RL_CRASH_AT=<point>:<step> (tests only): the process exits at once (as if killed)
    at that point of that step; points are `rollout` (after generating), `update` (after the
    optimizer step, before publishing), `checkpoint` (after the adapter files, before the state
    that records the step)."""
    value = os.environ.get("EPILORA_RL_CRASH_AT")
    if not value:
        return None
    point, _, step = value.partition(":")
    return point, int(step)
