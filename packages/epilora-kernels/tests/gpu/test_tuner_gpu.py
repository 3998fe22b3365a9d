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


def test_where_the_paths_are_close_the_tuner_times_both_and_the_dispatcher_takes_its_choice(
        tmp_path, monkeypatch):
    # Several slots at 16 tokens (`dispatch.timed_choice`): the fused path, compiled inside the
    # search, is timed beside the tuned decode path and held to the same answer; the faster is
    # cached, and lora_linear without a path takes it, with the reference's answer.
    import torch

    import epilora_kernels as ek
    from epilora_kernels import launch, reference

    monkeypatch.setenv("EPILORA_CACHE_DIR", str(tmp_path))
    launch.clear_table_cache()
    try:
        projections = {"qkv": (1024, (512, 256, 256))}
        report = tuner.tune_decode(projections, rank=16, slots=4, tokens=(16,), budget_s=240,
                                   reps=3, progress=lambda line: None)
        assert report["complete"] and not report.get("failed"), report.get("failed")
        (cell,) = report["cells"]
        assert cell["path"] in ("decode", "fused") and cell["fused_us"] > 0, cell
        x, weight, scale, lora, batch = tuner._problem(16, 1024, (512, 256, 256), 16, 4,
                                                       torch.device("cuda"))
        support = ek.device_support("cuda")
        # the cached choice itself (the rule alone would give the decode path too)
        table = launch.table_device(support.name, support.arch) or support.name
        assert launch.tuned_path(table, 16, 1024, 1024, 16, 4,
                                 cache_device=support.name) == cell["path"]
        assert ek.choose_path(16, batch, support, lora) == cell["path"]
        got = ek.lora_linear(x, weight, scale, lora, batch)
        want = reference.fused_lora_fp8_linear(x, weight, scale, lora, batch)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        assert err < 1e-2, err
    finally:
        launch.clear_table_cache()
