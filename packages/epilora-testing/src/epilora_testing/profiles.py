"""Hypothesis profiles, selected with EPILORA_HYPOTHESIS_PROFILE or pytest's --hypothesis-profile.

* `dev` (default): 25 examples, for quick local runs.
* `ci`: 200 examples per property, derandomized so a commit's run is reproducible.
* `gpu`: 200 examples, no deadline (the first example of a property pays for JIT compilation).
* `gpu-explore`: 100 examples and no shrinking, for a first look on a time-limited GPU lease
  (a failure is reported as found, unshrunk).
* `nightly`: 2,000 random examples.
"""

from hypothesis import HealthCheck, Phase, settings

PROFILES = {
    "dev": {"max_examples": 25, "deadline": None},
    "ci": {"max_examples": 200, "derandomize": True, "deadline": None, "print_blob": True},
    "gpu": {
        "max_examples": 200,
        "derandomize": True,
        "deadline": None,
        "print_blob": True,
        "suppress_health_check": [HealthCheck.too_slow],
    },
    "gpu-explore": {
        "max_examples": 100,
        "derandomize": True,
        "deadline": None,
        "print_blob": True,
        "phases": [Phase.explicit, Phase.reuse, Phase.generate],
        "suppress_health_check": [HealthCheck.too_slow],
    },
    "nightly": {"max_examples": 2000, "deadline": None, "print_blob": True},
}


def register_profiles() -> None:
    """Register every profile with hypothesis (idempotent)."""
    for name, kwargs in PROFILES.items():
        settings.register_profile(name, **kwargs)
