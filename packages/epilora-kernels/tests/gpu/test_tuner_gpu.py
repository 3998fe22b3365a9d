"""The tuner on the H200: its candidates compiled first in worker processes (started as
commands, as an engine's daemonic process must), then timed, the search reading what the
workers compiled from Triton's disk cache; K1's candidates with every slice in one program give
the settings in use's answer."""

from epilora_kernels import tuner


def test_the_tuner_compiles_in_worker_processes_then_times_every_bucket(tmp_path, monkeypatch):
    # Triton's disk cache empty and of this test alone: the workers compile every kernel there
    # (the search's own compiles would add entries after theirs).
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    # two slices: K1's candidates with every slice in one program among those timed, each
    # held to the settings in use's answer (`failed` lists any that is not)
    report = tuner.tune_decode({"gate_up": (1024, (512, 512))}, rank=16, tokens=(1, 8),
                               jobs=2, budget_s=240, reps=3, write=False,
                               progress=lambda line: None)
    assert report["compile_errors"] == [], report["compile_errors"]
    assert report["complete"] and len(report["cells"]) == 2
    assert not report.get("failed"), report.get("failed")
    assert list(cache.rglob("*.cubin")), f"the workers compiled nothing into {cache}"
