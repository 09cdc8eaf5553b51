"""Importing and dispatching vla_runtime.kernels without CuPy or a GPU: the 'torch' backend with a
reason that says what is missing, a loader that refuses with KernelUnavailable (never a crash or
a hang), and kernel sources that agree with the names and shapes the launchers use."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from vla_runtime import kernels
from vla_runtime.kernels import launch, loader

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_loader(monkeypatch):
    monkeypatch.setenv(kernels.ENV_BACKEND, "auto")   # what a user sets to turn the kernels on
    loader.reset()
    yield
    loader.reset()


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError


def _fake_cupy(devices: int = 1, compile_error: str | None = None, runtime_error: str | None = None,
               compiled: list[str] | None = None):
    """Just enough of CuPy's surface for the loader's probing and compiling paths. It compiles
    nothing: ``compiled`` collects the source texts ``compile()`` was called on (what the loader
    asked for); whether those texts compile is test_nvcc_compile.py's job, with the real nvcc."""

    def count():
        if runtime_error:
            raise RuntimeError(runtime_error)
        return devices

    class RawModule:
        def __init__(self, code, options=()):
            self.code = code

        def compile(self):
            if compile_error:
                raise RuntimeError(compile_error)
            if compiled is not None:
                compiled.append(self.code)

        def get_function(self, name):
            if f"void {name.rsplit('_', 1)[0]}_##SUFFIX(" not in self.code:  # declared through the dtype macro
                raise RuntimeError(f"no function {name}")
            return name

    runtime = types.SimpleNamespace(getDeviceCount=count, getDeviceProperties=lambda i: {"name": b"Fake GPU"})
    cuda = types.SimpleNamespace(runtime=runtime, Device=lambda i: nullcontext())
    return types.SimpleNamespace(__version__="0.fake", cuda=cuda, RawModule=RawModule)


def test_import_without_cupy_selects_torch_with_a_clear_reason(no_cupy):
    backend = kernels.kernel_backend()
    assert backend.name == "torch"
    assert "CuPy is not installed" in backend.reason and "pip install cupy-cuda1" in backend.reason


def test_a_fresh_interpreter_imports_the_package_without_importing_cupy():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import vla_runtime.kernels as k, vla_runtime.cache.action_cache, vla_runtime.cache.context_cache\n"
            "b = k.kernel_backend(); print(b.name); print(b.reason)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    name, reason = out.stdout.splitlines()[:2]
    assert name == "torch" and "CuPy is not installed" in reason


def test_cupy_without_a_device_selects_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(devices=0))
    assert kernels.kernel_backend() == ("torch", "CuPy is installed but no CUDA device is visible")
    loader.reset()
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(runtime_error="cudaErrorNoDevice: no CUDA-capable device"))
    backend = kernels.kernel_backend()
    assert backend.name == "torch" and "no usable CUDA driver or device" in backend.reason
    assert "cudaErrorNoDevice" in backend.reason


def test_cupy_with_a_device_selects_cupy_and_asks_it_to_compile_every_module(monkeypatch):
    """The loader hands CuPy each module's full text (headers inlined) and compiles it before
    reporting the backend usable. The fake compiles nothing, so this checks the loader's side
    only; the same texts go through the real nvcc in test_nvcc_compile.py::test_loader_text_compiles."""
    compiled: list[str] = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(compiled=compiled))
    backend = kernels.kernel_backend(device=0, compile_kernels=True)
    assert backend.name == "cupy", backend.reason
    assert "CuPy 0.fake" in backend.reason and "Fake GPU" in backend.reason and "compiled" in backend.reason
    assert sorted(compiled) == sorted(loader.read_source(m, ROOT / "cuda") for m in loader.MODULES)
    assert not any(re.search(r'^\s*#\s*include\s+"', code, re.MULTILINE) for code in compiled)   # headers inlined
    for module, source in loader.MODULES.items():
        names = re.findall(r"void (\w+)_##SUFFIX\(", (ROOT / "cuda" / source).read_text())
        for name in names:
            for suffix in launch.SUFFIX.values():
                assert loader.function(module, f"{name}_{suffix}", 0) == f"{name}_{suffix}"


def test_a_compile_failure_is_refused_once_and_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(compile_error="error: identifier 'x' is undefined"))
    with pytest.raises(kernels.KernelUnavailable, match="masked_ffn.cu failed to compile on device 0.*undefined"):
        loader.function("masked_ffn", "masked_ffn_act_f32", 0)
    with pytest.raises(kernels.KernelUnavailable, match="failed to compile"):  # remembered, not retried
        loader.function("masked_ffn", "masked_ffn_down_f32", 0)
    backend = kernels.kernel_backend(device=0)
    assert backend.name == "torch" and "failed to compile" in backend.reason


def test_the_loader_refuses_without_cupy_and_without_sources(no_cupy, monkeypatch, tmp_path):
    with pytest.raises(kernels.KernelUnavailable, match="CuPy is not installed"):
        loader.function("rms_norm", "fused_add_rms_norm_f32", 0)
    monkeypatch.setattr(loader, "source_dirs", lambda: [tmp_path])
    with pytest.raises(kernels.KernelUnavailable, match="sources .* not found in .*VLA_RUNTIME_CUDA_DIR"):
        loader.source_dir()


def test_the_backend_setting(monkeypatch, no_cupy):
    monkeypatch.setenv(kernels.ENV_BACKEND, "torch")
    assert kernels.kernel_backend() == ("torch", "VLA_RUNTIME_KERNELS=torch: the CUDA kernels are switched off")
    monkeypatch.setenv(kernels.ENV_BACKEND, "triton")
    with pytest.raises(ValueError, match="VLA_RUNTIME_KERNELS='triton': choose one of auto, torch, cupy"):
        kernels.kernel_backend()
    monkeypatch.delenv(kernels.ENV_BACKEND)
    assert kernels.backend_setting() == "torch"          # off by default until checked on a GPU
    assert "off by default" in kernels.kernel_backend().reason
    with kernels.use_backend("auto"):
        assert kernels.backend_setting() == "auto"
    assert kernels.backend_setting() == "torch"


def test_cpu_tensors_take_the_fallback_even_when_cupy_is_asked_for(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    x = torch.randn(4, 8)
    with kernels.use_backend("cupy"):
        assert not kernels.would_use_cupy(x, "masked_ffn")
        res, normed = kernels.fused_add_rms_norm(x.clone(), None, torch.ones(8), 1e-6)
    assert torch.equal(res, x) and normed.shape == x.shape


def test_launchable_needs_one_cuda_device_and_contiguous_supported_tensors():
    x = torch.randn(4, 8)
    assert not launch.launchable(x)  # CPU
    assert not launch.launchable(None)


def test_sources_inline_their_headers_once():
    for module in loader.MODULES:
        text = loader.read_source(module)
        assert not re.search(r'^\s*#\s*(include\s+"|pragma\s+once)', text, re.MULTILINE)
        assert text.count("struct bf16_t {") == 1


def test_launch_constants_match_the_kernel_sources():
    ffn = (ROOT / "cuda" / "ffn.cuh").read_text()
    assert int(re.search(r"#define VLA_DOWN_ROWS (\d+)", ffn).group(1)) == launch.DOWN_ROWS
    assert launch.NORM_THREADS % 32 == 0 and launch.NORM_THREADS <= 1024
    assert launch.DOWN_THREADS % 32 == 0 and 32 * launch.ACT_WARPS <= 1024
    # every kernel the launchers call exists in its module for every dtype suffix
    called = re.findall(r'_run\("(\w+)", "(\w+)"', (ROOT / "vla_runtime" / "kernels" / "launch.py").read_text())
    assert len(called) == 6
    for module, name in called:
        assert f"void {name}_##SUFFIX(" in (ROOT / "cuda" / loader.MODULES[module]).read_text()
