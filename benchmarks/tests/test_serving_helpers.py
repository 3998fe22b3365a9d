"""benchmarks/serving.py's result rows, from engine logs (no engine: the parsing and the merge
of several runs' logs, which the result file and the docs page come from)."""

import contextlib
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SERVING = runpy.run_path(str(Path(__file__).parents[1] / "serving.py"))


def _log(tpots, tokens, kv=785_488, base=None):
    result = {"start_s": 100.0, "tpot_ms": tpots, "tpot_ms_base_request": base,
              "tokens": tokens, "gpu": "NVIDIA H200", "torch": "2.11.0", "vllm": "0.26.0"}
    return (f"INFO [kv_cache_utils.py:2177] GPU KV cache size: {kv:,} tokens\n"
            f"RESULT {json.dumps(result)}\n")


def test_rows_from_a_log_and_none_from_an_engine_that_did_not_finish():
    rows, tokens = SERVING["rows_from_log"]("qwen3-8b", "epilora",
                                            _log([4.3, 4.1, 4.2], [[1, 2]], base=[3.9, 3.8]))
    by_metric = {r["metric"]: r for r in rows}
    assert by_metric["tpot_ms"]["value"] == 4.2 and by_metric["tpot_ms"]["n"] == 3
    assert by_metric["tpot_ms_base_request"]["value"] == pytest.approx(3.85)
    assert by_metric["kv_cache_tokens"]["value"] == 785_488
    assert tokens == [[1, 2]]
    assert SERVING["rows_from_log"]("qwen3-8b", "epilora", "Traceback ...\n") == ([], None)


def test_collect_takes_the_later_runs_log_and_counts_agreement(tmp_path):
    old, new = tmp_path / "aaa", tmp_path / "bbb"
    old.mkdir(), new.mkdir()
    (old / "serving-qwen3-8b-epilora.log").write_text(_log([9.0], [[1], [2]]))
    (old / "serving-qwen3-8b-vllm-dual-stream.log").write_text(_log([5.5], [[1], [3]]))
    (new / "serving-qwen3-8b-epilora.log").write_text(_log([4.0], [[1], [3]]))
    rows = SERVING["collect"]([old, new])
    tpot = {r["system"]: (r["value"], r["log"]) for r in rows if r["metric"] == "tpot_ms"}
    assert tpot == {"epilora": (4.0, "bbb/serving-qwen3-8b-epilora.log"),
                    "vllm-dual-stream": (5.5, "aaa/serving-qwen3-8b-vllm-dual-stream.log")}
    (same,) = [r for r in rows if r["metric"] == "same_greedy_outputs"]
    assert same["against"] == "vllm-dual-stream" and (same["value"], same["n"]) == (2, 2)


def test_a_tenants32_log_gives_throughput_and_graph_capture_rows_under_its_scenario(tmp_path):
    result = {"start_s": 150.0, "output_tokens_per_s": [9000.0, 9100.0, 8800.0],
              "gpu": "NVIDIA H200", "torch": "2.11.0", "vllm": "0.26.0"}
    run = tmp_path / "0123abc"
    run.mkdir()
    name = SERVING["log_name"]("llama3.1-8b", "tenants32", "vllm-default")
    assert name == "serving-llama3.1-8b-tenants32-vllm-default.log"
    (run / name).write_text(
        "COMMAND python3 benchmarks/serving.py --scenarios tenants32\n"
        "INFO [model_runner.py:747] Graph capturing finished in 15 secs, took 0.42 GiB\n"
        f"RESULT {json.dumps(result)}\n")
    (run / "serving-llama3.1-8b-epilora.log").write_text(_log([4.0], [[1]]))
    rows = SERVING["collect"]([run])
    tenants = {r["metric"]: r for r in rows if r["scenario"] == "tenants32"}
    assert tenants["output_tokens_per_s"]["value"] == 9000.0
    assert tenants["output_tokens_per_s"]["adapters"] == 32
    assert (tenants["graph_capture_s"]["value"], tenants["graph_capture_gib"]["value"]) == (
        15.0, 0.42)
    assert {r["commit"] for r in rows} == {"0123abc"}
    assert tenants["start_s"]["command"] == "python3 benchmarks/serving.py --scenarios tenants32"
    assert {r["scenario"] for r in rows if r["system"] == "epilora"} == {"tpot1"}


def test_an_online_log_gives_median_tpot_and_p99_ttft_per_rate_and_the_page_judges_them(
        tmp_path, monkeypatch):
    def rates(tpot, ttft):
        return {str(rate): {"completed": 60, "failed": 0, "median_tpot_ms": tpot * rate,
                            "p99_ttft_ms": ttft, "median_ttft_ms": ttft / 2,
                            "output_throughput": 1000.0} for rate in (2.0, 4.0)}

    run = tmp_path / "0123abc"
    run.mkdir()
    for system, tpot, ttft in (("epilora", 8.0, 100.0), ("vllm-default", 10.0, 95.0)):
        result = {"start_s": 200.0, "rates": rates(tpot, ttft), "gpu": "NVIDIA H200",
                  "torch": "2.11.0", "vllm": "0.26.0"}
        (run / SERVING["log_name"]("qwen3-8b", "online", system)).write_text(
            f"COMMAND python3 benchmarks/serving.py --scenarios online\n"
            f"RESULT {json.dumps(result)}\n")
    rows = SERVING["collect"]([run])
    tpot = {(r["system"], r["request_rate"]): r["value"] for r in rows
            if r["metric"] == "median_tpot_ms"}
    assert tpot == {("epilora", 2.0): 16.0, ("epilora", 4.0): 32.0,
                    ("vllm-default", 2.0): 20.0, ("vllm-default", 4.0): 40.0}
    assert {r["scenario"] for r in rows} == {"online"}

    render = runpy.run_path(str(Path(__file__).parents[2] / "tools/render_serving_docs.py"))
    lines = "\n".join(render["online_lines"](rows))
    assert "4 requests/s, median TPOT against vllm-default: **0.800x** (target at most " \
           "0.85x: met)" in lines
    assert "2 requests/s, p99 TTFT against vllm-default: **1.053x** (target at most 1.1x: " \
           "met)" in lines


def test_an_online_engine_stopped_at_its_third_rate_keeps_the_two_it_finished(tmp_path):
    # The worker prints the rates so far after each one; the last line counts.
    def result(*rates):
        return {"start_s": 300.0, "gpu": "NVIDIA H200", "torch": "2.11.0", "vllm": "0.26.0",
                "rates": {str(r): {"completed": 40, "failed": 0, "median_tpot_ms": 10.0 * r,
                                   "p99_ttft_ms": 100.0} for r in rates}}

    run = tmp_path / "0123abc"
    run.mkdir()
    (run / SERVING["log_name"]("qwen3-8b", "online", "vllm-default")).write_text(
        f"COMMAND python3 benchmarks/serving.py --scenarios online\n"
        f"RESULT {json.dumps(result(2.0))}\nRESULT {json.dumps(result(2.0, 4.0))}\n"
        f"a client's progress, then the time limit\n")
    rows = SERVING["collect"]([run])
    assert sorted((r["request_rate"], r["value"]) for r in rows
                  if r["metric"] == "median_tpot_ms") == [(2.0, 20.0), (4.0, 40.0)]


def test_a_later_online_run_at_one_more_rate_adds_to_the_earlier_runs_rates(tmp_path):
    def result(start_s, **tpot_by_rate):
        return {"start_s": start_s, "gpu": "NVIDIA H200", "torch": "2.11.0", "vllm": "0.26.0",
                "rates": {rate: {"completed": 40, "failed": 0, "median_tpot_ms": tpot,
                                 "p99_ttft_ms": 100.0} for rate, tpot in tpot_by_rate.items()}}

    name = SERVING["log_name"]("llama3.1-8b", "online", "vllm-default")
    for run, res in (("aaaaaaa", result(150.0, **{"2.0": 12.0, "4.0": 25.0})),
                     ("bbbbbbb", result(220.0, **{"4.0": 30.0, "16.0": 44.0}))):
        (tmp_path / run).mkdir()
        (tmp_path / run / name).write_text(f"RESULT {json.dumps(res)}\n")
    rows = SERVING["collect"]([tmp_path / "aaaaaaa", tmp_path / "bbbbbbb"])
    tpot = sorted((r["request_rate"], r["value"], r["commit"]) for r in rows
                  if r["metric"] == "median_tpot_ms")
    # 4 requests/s from the later run, which served it too; 2 from the earlier, which alone did
    assert tpot == [(2.0, 12.0, "aaaaaaa"), (4.0, 30.0, "bbbbbbb"), (16.0, 44.0, "bbbbbbb")]
    assert [(r["value"], r["commit"]) for r in rows if r["metric"] == "start_s"] == [
        (220.0, "bbbbbbb")]


def test_a_rate_stock_did_not_reach_is_named_and_not_judged():
    def row(system, rate, metric, value):
        return {"system": system, "request_rate": rate, "metric": metric, "value": value,
                "n": 40, "failed": 0}

    rows = [row("epilora", rate, metric, 1.0) for rate in (2.0, 4.0)
            for metric in ("median_tpot_ms", "p99_ttft_ms")]
    rows += [row("vllm-default", 2.0, metric, 2.0) for metric in ("median_tpot_ms", "p99_ttft_ms")]
    render = runpy.run_path(str(Path(__file__).parents[2] / "tools/render_serving_docs.py"))
    lines = "\n".join(render["online_lines"](rows))
    assert "2 requests/s, median TPOT against vllm-default: **0.500x**" in lines
    assert "4 requests/s, median TPOT: no stock LoRA configuration measured" in lines
    assert "4 requests/s, median TPOT against" not in lines


def test_a_target_is_judged_only_on_one_runs_rows():
    # Side by side means one run (one commit's logs, one machine): a ratio of two runs' rows
    # is shown but not judged.
    def row(system, metric, value, commit):
        return {"system": system, "metric": metric, "value": value, "commit": commit}

    render = runpy.run_path(str(Path(__file__).parents[2] / "tools/render_serving_docs.py"))
    same = {"epilora": {"tpot_ms": row("epilora", "tpot_ms", 3.0, "aaaaaaa")},
            "no-lora": {"tpot_ms": row("no-lora", "tpot_ms", 3.0, "aaaaaaa")}}
    assert "**1.000x** (target at most 1.05x: met)" in "\n".join(
        render["target_lines"]("tpot1", same))
    apart = {**same, "no-lora": {"tpot_ms": row("no-lora", "tpot_ms", 3.0, "bbbbbbb")}}
    said = "\n".join(render["target_lines"]("tpot1", apart))
    assert "**1.000x** (target at most 1.05x: not judged: rows of runs `aaaaaaa` and " \
           "`bbbbbbb`, not one run's)" in said
    assert ": met" not in said


def _start_log(start_s, *, load_s, compile_s, tunes=()):
    result = {"start_s": start_s, "gpu": "NVIDIA H200", "torch": "2.11.0", "vllm": "0.26.0"}
    tuned = "".join(f"INFO [tuning.py:96] epilora tune: 4096x4096 r64 l32 on codes in {s} s "
                    f"(compiles {s - 1} s, complete): 5 token buckets\n" for s in tunes)
    return (f"COMMAND python3 benchmarks/serving.py --scenarios start\n{tuned}"
            f"INFO [model_runner.py:305] Model loading took 20.73 GiB and {load_s} seconds\n"
            f"INFO [monitor.py:53] torch.compile took {compile_s} s in total\n"
            f"RESULT {json.dumps(result)}\n")


def test_the_start_scenario_gives_first_and_later_starts_with_their_parts_and_the_page_judges(
        tmp_path):
    run = tmp_path / "0123abc"
    run.mkdir()
    logs = {("start", "epilora"): _start_log(250.0, load_s=60.0, compile_s=130.0,
                                             tunes=(14.5, 16.0)),
            ("restart", "epilora"): _start_log(95.0, load_s=4.0, compile_s=8.0),
            ("start", "vllm-default"): _start_log(170.0, load_s=3.5, compile_s=80.0),
            ("restart", "vllm-default"): _start_log(80.0, load_s=3.5, compile_s=7.0)}
    for (scenario, system), log in logs.items():
        (run / SERVING["log_name"]("qwen3-8b", scenario, system)).write_text(log)
    rows = SERVING["collect"]([run])
    got = {(r["scenario"], r["system"], r["metric"]): r["value"] for r in rows}
    assert got[("start", "epilora", "start_s")] == 250.0
    assert got[("start", "epilora", "epilora_tune_s")] == 30.5
    assert got[("restart", "epilora", "epilora_tune_s")] == 0  # tuned nothing: a row of 0
    assert ("start", "vllm-default", "epilora_tune_s") not in got
    assert got[("start", "vllm-default", "torch_compile_s")] == 80.0
    assert got[("restart", "vllm-default", "model_load_s")] == 3.5

    render = runpy.run_path(str(Path(__file__).parents[2] / "tools/render_serving_docs.py"))
    starts: dict = {}
    for r in rows:
        starts.setdefault(r["scenario"], {}).setdefault(r["system"], {})[r["metric"]] = r
    lines = "\n".join(render["start_lines"](starts))
    assert "| epilora | 250 | 60 | 30 | 130 | - | 95 | 8 |" in lines
    assert "First start against stock's vllm-default: **+80 s** (target at most +90 s: met)" \
        in lines
    assert "Later start against stock's vllm-default: **+15 s** (target at most +10 s: not " \
           "met)" in lines


def test_an_engine_of_the_start_scenario_gets_every_cache_under_its_own_root(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("EPILORA_CACHE_DIR", "/shared/epilora")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/shared/triton")
    env = SERVING["cache_env"](tmp_path)
    assert "EPILORA_CACHE_DIR" not in env  # the plugin's tuning then follows XDG_CACHE_HOME
    for name in ("XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR",
                 "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH"):
        assert Path(env[name]).is_relative_to(tmp_path), name


def _alive(pid: int) -> bool:
    # a zombie (exited, not yet reaped: a container's init may not reap) counts as dead
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_sigterm_to_a_script_kills_its_workers_process_groups(tmp_path):
    # A script that runs a worker (which starts a child of its own, as vLLM's engine core) and
    # sets no handler itself, stopped by SIGTERM as the device step's `timeout` stops it: the
    # worker's child must not outlive it (dev/engine_kernels.py's once held the GPU's memory).
    pid_file = tmp_path / "child.pid"
    worker = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    serving = str(Path(__file__).parents[1] / "serving.py")
    script = (f"import runpy, sys; run_worker = runpy.run_path({serving!r})['run_worker']; "
              f"run_worker([sys.executable, '-c', {worker!r}], timeout=120)")
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the worker never started its child"
            assert parent.poll() is None, "the script exited before its worker started"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert _alive(child)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), f"the worker's child {child} outlived the script"
    finally:  # (where it failed) the worker and its child share a process group
        parent.kill()
        parent.wait()
        if pid_file.exists() and pid_file.read_text():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(int(pid_file.read_text())), signal.SIGKILL)


def test_the_online_client_commands_parse_as_vllms_and_each_rate_has_its_own_prompts():
    # vLLM's own parser of `vllm bench serve` reads the warm-up's and every rate's commands;
    # each rate and the warm-up draw prompts of seeds of their own (one seed made a rate's
    # prompts the first of the next rate's, which then met the prefix cache).
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    names = [f"tenant-{t}" for t in range(SERVING["TENANTS"])]
    warm = parser.parse_args(SERVING["bench_client"](
        8000, "/m", names, "inf", len(names), 1, SERVING["WARM_UP_SEED"])[3:])
    assert (warm.request_rate, warm.num_prompts, warm.lora_modules) == (
        float("inf"), len(names), names)
    seeds = [parser.parse_args(SERVING["bench_client"](
        8000, "/m", names, rate, 60, 256, SERVING["rate_seed"](rate))[3:]).seed
        for rate in SERVING["RATES"]]
    assert len({*seeds, warm.seed}) == len(seeds) + 1, seeds
    no_lora = parser.parse_args(SERVING["bench_client"](8000, "/m", [], 2.0, 60, 256, 2)[3:])
    assert not no_lora.lora_modules
