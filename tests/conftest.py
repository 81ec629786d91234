"""Fixtures shared across the test suite."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def _patch_the_language_once_a_launch() -> None:
    """Triton's interpreter patches triton.language's modules for itself at every call of a device
    function (kernels/'s helpers: thousands in a launch), though the launch patched them already:
    about a third of the interpreted kernels' time. Here a device function called in a launch
    patches only the language modules that the launch has not patched yet (standard.py's `core`,
    say), as the interpreter does (and never undoes: its nested patches outlive the launch); then
    it runs as before. Left as it is where this Triton's interpreter is laid out otherwise."""
    import triton.language as tl
    from triton.runtime import interpreter

    grid_executor, device_function = interpreter.GridExecutor, interpreter.InterpretedFunction
    if not all(hasattr(o, a) for o, a in ((interpreter, "_patch_lang"), (grid_executor, "__call__"),
                                          (device_function, "rewrite"), (interpreter, "InterpreterError"))):
        return
    launch, launch_call, call = threading.local(), grid_executor.__call__, device_function.__call__
    languages: dict = {}  # a function's language modules, by function

    def modules(fn) -> frozenset[int]:
        if fn not in languages:
            languages[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return languages[fn]

    def run_launch(self, *args, **kwargs):
        outer = getattr(launch, "patched", None)
        launch.patched = set(modules(self.fn))  # the launch's own _patch_lang(self.fn)
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            launch.patched = outer

    def call_device_function(self, *args, **kwargs):
        patched = getattr(launch, "patched", None)
        if patched is None:  # outside a launch: the interpreter's own (which raises)
            return call(self, *args, **kwargs)
        if not modules(self.fn) <= patched:
            interpreter._patch_lang(self.fn)
            patched |= modules(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    grid_executor.__call__, device_function.__call__ = run_launch, call_device_function


if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    # Without a GPU the Triton kernels can still run, on CPU tensors, through Triton's interpreter;
    # but triton picks interpreter or compiler as each jit function is defined (its own tl.sum
    # included), so it must be imported in interpreter mode, before anything else imports it. The
    # variable is cleared again so that use_triton() keeps CPU tensors on the torch references,
    # except in tests that set it back (the triton_interpreter fixture in tests/kernels/).
    os.environ["TRITON_INTERPRET"] = "1"
    import triton

    triton.knobs.runtime.interpret = True  # stays on for the kernels in kernels/, defined later
    del os.environ["TRITON_INTERPRET"]  # after the knob, which sets it too
    _patch_the_language_once_a_launch()

from engine.model_store import DEFAULT_DIR_NAME, ensure_default_model


@pytest.fixture(autouse=True, scope="session")
def small_cpu_kv_budget() -> Iterator[None]:
    """Engines this process builds without kv_cache_memory hold 256 MiB of KV on CPU, not 1 GiB: the
    suite builds dozens, and first touching each GiB (zeroing it) costs up to a second."""
    from engine import builder

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "CPU_KV_BUDGET", 256 << 20)
        yield


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """For one test, send CPU tensors to the Triton kernels, run by Triton's interpreter.

    tests/conftest.py imports triton in interpreter mode when there is no GPU; this only sets
    TRITON_INTERPRET=1 (which use_triton() reads) until the test ends.
    """
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import rmsnorm

    if not isinstance(rmsnorm._rms_norm_kernel, InterpretedFunction):
        pytest.skip("Triton is compiling for the GPU here; tests/gpu/test_kernels_cuda.py runs these kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def few_row_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send up to FEW_ROWS rows of every dtype through the few-row epilogue kernels, which the linear
    layers use only up to split_k.FUSED_ROWS and float_linear.FLOAT_FUSED_ROWS (one row for FP8, INT4
    and float32 weights), so that those kernels stay under test."""
    from kernels import float_linear, split_k

    monkeypatch.setattr(split_k, "FUSED_ROWS", split_k.FEW_ROWS)
    monkeypatch.setattr(float_linear, "FLOAT_FUSED_ROWS", dict.fromkeys(float_linear.FLOAT_FUSED_ROWS, split_k.FEW_ROWS))


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted default model: reused from $MINILLM_MODELS_DIR if set, else converted once
    per run (~20 s) under pytest's temporary directory; xdist's workers share it (the conversion
    locks, so the second waits for the first rather than converting beside it)."""
    if os.environ.get("MINILLM_MODELS_DIR"):
        return ensure_default_model()
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    return ensure_default_model(root / "models" / DEFAULT_DIR_NAME)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: a random-weight checkpoint of a named tiny shape, built and saved by transformers
    with a fixed seed (made once per session), and the transformers model itself as the reference."""
    import torch
    import transformers

    from engine.models.shapes import shape_config

    made: dict[tuple[str, tuple], tuple[Path, transformers.PreTrainedModel]] = {}

    def make(shape: str, **overrides) -> tuple[Path, transformers.PreTrainedModel]:
        key = (shape, tuple(sorted(overrides.items())))
        if key not in made:
            cfg = {**shape_config(shape), **overrides}
            model_type = cfg.pop("model_type")
            # A wide init makes the logits peaked, so greedy choices are not near-ties.
            hf_config = transformers.AutoConfig.for_model(model_type, initializer_range=0.2, **cfg)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
            with torch.no_grad():  # transformers inits biases to 0 and norms to 1: make them count
                for name, param in model.named_parameters():
                    if name.endswith("bias"):
                        param.normal_(0.0, 0.5)
                    elif name.endswith("norm.weight"):
                        param.uniform_(0.5, 1.5)
            path = tmp_path_factory.mktemp(shape)
            model.save_pretrained(path)
            made[key] = (path, model)
        return made[key]

    return make


@pytest.fixture(scope="session")
def hf_default(default_model_dir: Path):
    """transformers' own model and tokenizer on the default model directory: the reference."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The shared server (tests/app/conftest.py's Server): the embedded model, float32 on CPU, no API
    key. Here, so that every package's tests share one process."""
    from tests.app.conftest import start_server

    s = start_server(default_model_dir, tmp_path_factory.mktemp("server") / "server.log")
    yield s
    s.stop()
