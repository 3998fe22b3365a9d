"""An adapter checked before the engine loads it, so that a bad one is refused with its reason
(HTTP 400 through the server) and never reaches a worker.

`check_adapter(path, hf_config, max_lora_rank)` raises `BadAdapter` for: no adapter_config.json
or one that is not JSON, a rank above the engine's `max_lora_rank`, a weights file that is
truncated or not safetensors, NaN or Inf in a tensor, and a tensor whose shape does not fit
the served model (an adapter made for another base model). A path that is not a local
directory (a hub id, a resolver's name) is left to vLLM.

`check_adapter_once` is the same check, its verdict kept while the adapter's files stay as they
were: `epilora_vllm.request_check` runs it wherever vLLM takes an adapter (a request that names
it, a load), whatever the entry point (`LLM` from Python, a server with or without the
middleware, an adapter a LoRA resolver brought in).

`refuse_bad_adapters` is the same check as an ASGI middleware of vLLM's OpenAI server, its
extension point for that (`vllm serve ... --middleware
epilora_vllm.adapter_check.refuse_bad_adapters`): a `POST /v1/load_lora_adapter` with a bad
adapter is answered 400 in vLLM's error format, every other request passes through untouched.
"""

import json
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
VERDICTS_KEPT = 1024  # adapter versions whose verdicts `check_adapter_once` remembers
# A decoder layer's projection of the language model (not a vision tower's `encoder.layers`),
# with or without PEFT's adapter name before `.weight`.
_MODULE = re.compile(r"(?:^|\.)(?:model|language_model)\.layers\.(\d+)\.(?:self_attn|mlp)\."
                     r"(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")


class BadAdapter(ValueError):
    """The adapter cannot be served; the message says why."""


# A decoder layer's projection among the modules of a model transformers builds.
_BUILT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)$")
_facts: dict[int, tuple] = {}  # id(config) -> (config, its facts): built once a config
_facts_lock = threading.Lock()


def projection_shapes(hf_config) -> dict[tuple[int, str], tuple[int, int]] | None:
    """(out_features, in_features) of each decoder layer's projection, keyed by (layer, name),
    as transformers' modeling code builds the model: on the meta device (no memory; about half
    a second for an 8B model), so that every layout it knows is right (gated attention's double
    q_proj, MLA's heads, layers of several kinds). None where transformers cannot build it (a
    model of remote code, a config that is not transformers'): the shapes are then vLLM's to
    check."""
    import torch
    import transformers

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            with torch.device("meta"):
                model = auto.from_config(hf_config)
        except Exception:  # an architecture or config transformers does not build
            continue
        shapes = {}
        for name, module in model.named_modules():
            match = _BUILT.search(name)
            if match is not None and isinstance(module, torch.nn.Linear):
                shapes[int(match[1]), match[2]] = (module.out_features, module.in_features)
        return shapes or None
    return None


def _model_facts(hf_config) -> tuple[dict | None, int | None, tuple | None]:
    """What the check reads of the model, built once a config: its decoder layers' projection
    shapes, its layer count, and the shapes as sorted (layer, name, out, in) rows (a verdict's
    key)."""
    text_config = getattr(hf_config, "text_config", None) or hf_config  # a VLM's decoder
    with _facts_lock:
        kept = _facts.get(id(text_config))
        if kept is None:  # the config is kept with its facts: its id is not reused
            shapes = projection_shapes(text_config)
            rows = tuple(sorted((*key, *shape) for key, shape in shapes.items())) \
                if shapes else None
            kept = _facts[id(text_config)] = (
                text_config, (shapes, getattr(text_config, "num_hidden_layers", None), rows))
    return kept[1]


def _local_dir(path) -> Path | None:
    # A path that is not a local directory (a hub id, a resolver's name, the RL engine's
    # memory:// adapters) is not ours to judge: vLLM resolves it (or says it found nothing).
    if not isinstance(path, (str, Path)) or not str(path):
        return None
    path = Path(path).expanduser()  # as vLLM's loader reads it (get_adapter_absolute_path)
    return path if path.is_dir() else None


def check_adapter(path, hf_config, max_lora_rank: int) -> None:
    """Raise `BadAdapter` if the PEFT adapter in directory `path` cannot serve this model."""
    directory = _local_dir(path)
    if directory is not None:
        _check_directory(directory, max_lora_rank, *_model_facts(hf_config)[:2])


def _check_directory(path: Path, max_lora_rank: int, shapes, layers) -> None:
    config_file = path / CONFIG
    if not config_file.is_file():
        raise BadAdapter(f"{path}: no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
        rank = int(config["r"])
        pattern = {k: int(v) for k, v in (config.get("rank_pattern") or {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadAdapter(f"{config_file}: not a PEFT LoRA config ({e})") from None
    highest = max([rank, *pattern.values()])
    if highest > max_lora_rank:
        raise BadAdapter(f"{path}: rank {highest} is above the engine's max_lora_rank "
                         f"{max_lora_rank}")
    weights = path / WEIGHTS
    if not weights.is_file():
        return  # .bin or .pt weights: vLLM's loader checks those
    # With a rank_pattern, a module's rank is its own: only the other dimension is checked.
    _check_weights(weights, None if pattern else rank, shapes, layers)


def _check_weights(weights: Path, rank: int | None, shapes, layers) -> None:
    import torch
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    raise BadAdapter(f"{weights}: {name} holds NaN or Inf")
                match = _MODULE.search(name)
                if match is None or shapes is None:
                    continue  # embeddings, lm_head, biases, other layouts: vLLM's own checks
                layer, module, side = int(match[1]), match[2], match[3]
                if layer >= layers:
                    raise BadAdapter(f"{weights}: {name} names no layer of this model "
                                     f"({layers} layers)")
                if (layer, module) not in shapes:
                    continue  # a projection this layer does not have: vLLM's to judge
                out, inp = shapes[layer, module]
                r = tensor.shape[0] if side == "A" else tensor.shape[-1]
                expected = (rank or r, inp) if side == "A" else (out, rank or r)
                if tuple(tensor.shape) != expected:
                    raise BadAdapter(
                        f"{weights}: {name} has shape {tuple(tensor.shape)}, this model's "
                        f"{module} at rank {rank} needs {expected} (an adapter for another "
                        "base model?)")
    except BadAdapter:
        raise
    except Exception as e:  # safetensors' errors: truncated, not safetensors at all
        raise BadAdapter(f"{weights}: not a readable safetensors file ({e})") from None


_verdicts: OrderedDict = OrderedDict()  # key -> None (served) or the refusal's message
_UNKNOWN = object()
_verdicts_lock = threading.Lock()


# A verdict on files changed this recently is not remembered: a filesystem with coarse
# timestamps could give a second write within the same tick the first one's version (git's
# "racily clean" files).
RACY_S = 2.0


def _file_version(file: Path) -> tuple[int, ...] | None:
    # ctime too: a copy that keeps the old modification time (cp -p, rsync -a) changes it.
    try:
        st = file.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def check_adapter_once(path, hf_config, max_lora_rank: int) -> None:
    """`check_adapter`, its verdict remembered for this model and rank limit while the adapter's
    config and weights keep their device, inode, size, modification and change times (a
    rewritten adapter is checked again); the `VERDICTS_KEPT` latest adapter versions are kept,
    none changed in the last `RACY_S` seconds."""
    directory = _local_dir(path)
    if directory is None:
        return
    shapes, layers, rows = _model_facts(hf_config)
    # The files' versions are read before the check: a write during it leaves a verdict under
    # the old version, and the next call checks the new one.
    versions = (_file_version(directory / CONFIG), _file_version(directory / WEIGHTS))
    # The path as given, not resolved (a stat per component, on every request): another
    # spelling of it only costs one more check.
    key = (str(directory), max_lora_rank, rows, layers, versions)
    changed = max((v[-1] for v in versions if v is not None), default=0) / 1e9
    with _verdicts_lock:
        verdict = _verdicts.get(key, _UNKNOWN)
        if verdict is not _UNKNOWN:
            _verdicts.move_to_end(key)
    if verdict is _UNKNOWN:
        try:
            _check_directory(directory, max_lora_rank, shapes, layers)
            verdict = None
        except BadAdapter as e:
            verdict = str(e)
        if time.time() - changed >= RACY_S:
            with _verdicts_lock:
                _verdicts[key] = verdict
                while len(_verdicts) > VERDICTS_KEPT:
                    _verdicts.popitem(last=False)
    if verdict is not None:
        raise BadAdapter(verdict)


def _authorized(request) -> bool:
    # Named by `--middleware`, this middleware runs outside vLLM's API-key check: look at an
    # adapter only for a caller vLLM would let through (others get vLLM's 401, their path
    # untouched), by vLLM's own test (AuthenticationMiddleware.verify_token: the scheme in
    # any case, the token after the first space), against vLLM's keys: the CLI's, or else
    # VLLM_API_KEY (as vLLM's server chooses them: a CLI key replaces the environment's).
    from vllm import envs

    args = getattr(request.app.state, "args", None)
    configured = getattr(args, "api_key", None) or envs.VLLM_API_KEY
    keys = [k for k in ([configured] if isinstance(configured, str) else configured or []) if k]
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    return not keys or (scheme.lower() == "bearer" and token in keys)


async def request_json(request) -> dict:
    """A request's JSON object body, or {} (vLLM answers a malformed request itself); the
    server middlewares' (this module's and `epilora_vllm.reload_guard`'s) reading of it."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


async def refuse_bad_adapters(request, call_next):
    """vLLM server middleware: `/v1/load_lora_adapter` with a bad adapter gets a 400."""
    if (request.method == "POST" and request.url.path.endswith("/v1/load_lora_adapter")
            and _authorized(request)):
        body = await request_json(request)
        config = getattr(request.app.state, "vllm_config", None)
        path = body.get("lora_path")
        if config is not None and config.lora_config is not None and isinstance(path, str):
            from starlette.concurrency import run_in_threadpool

            try:  # reading the weights off the event loop: other requests go on
                await run_in_threadpool(check_adapter_once, path,
                                        config.model_config.hf_config,
                                        config.lora_config.max_lora_rank)
            except BadAdapter as e:
                from fastapi.responses import JSONResponse

                return JSONResponse(status_code=400, content={"error": {
                    "message": str(e), "type": "BadRequestError", "param": "lora_path",
                    "code": 400}})
    return await call_next(request)
