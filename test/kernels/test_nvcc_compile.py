"""Every CUDA kernel source compiles with nvcc for the GPUs users have (CI has nvcc, no GPU).

Architectures: sm_80 (A100), sm_86 (RTX 30xx), sm_87 (Jetson Orin), sm_89 (RTX 40xx), sm_90
(H100/H200) always; and, where the installed nvcc lists them, sm_100 (B200), sm_101 (Jetson Thor
on CUDA 12.8/12.9), sm_110 (Jetson Thor on CUDA 13) and sm_120 (RTX 50xx). Each source is compiled
once into a fat binary holding all of them (one nvcc per file, the files in parallel), warnings
as errors. The exact text the loader hands to CuPy/NVRTC (headers inlined) is compiled too.

No nvcc is a failure, not a skip: this check is the only proof CI has that the kernels build.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from vla_runtime.kernels import loader

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "cuda"
REQUIRED_ARCHS = (80, 86, 87, 89, 90)
OPTIONAL_ARCHS = (100, 101, 110, 120)
TIMEOUT_S = 300  # bounds a hung compiler only; a normal run takes seconds


def find_nvcc() -> str:
    """nvcc on PATH, under $CUDA_HOME / $CUDA_PATH, or /usr/local/cuda; fails the test run if none."""
    candidates = [shutil.which("nvcc")]
    candidates += [str(Path(os.environ[v]) / "bin" / "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    pytest.fail("nvcc not found (PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin): the CUDA kernel "
                "compile check needs the CUDA toolkit's compiler; install it (CI images have it)", pytrace=False)


def listed_archs(nvcc: str) -> set[int]:
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.fail(f"`nvcc --list-gpu-arch` failed: {out.stderr.strip()}", pytrace=False)
    return {int(m) for m in re.findall(r"compute_(\d+)", out.stdout)}


@dataclass
class Build:
    label: str
    command: list[str]
    returncode: int
    stderr: str
    output: Path


ELF_ENTRY = 2   # fatbin entry kind of a cubin (1 is PTX)


def fatbin_cubin_archs(path: Path) -> set[int]:
    """SM architectures of the cubins inside an nvcc fat binary, read from the file itself.

    Layout (CUDA's fatbinary format): a 16-byte header (magic 0xBA55ED50, u16 version, u16 header
    size, u64 payload size), then entries, each a header (u16 kind, u16, u32 header size, u64
    payload size, ..., u32 arch at byte 28) followed by its payload."""
    import struct

    data = path.read_bytes()
    magic, _, header, size = struct.unpack_from("<IHHQ", data, 0)
    assert magic == 0xBA55ED50, f"{path} is not a CUDA fat binary (magic {magic:#x})"
    archs, off = set(), header
    while off < header + size:
        kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, off)
        if kind == ELF_ENTRY:
            archs.add(struct.unpack_from("<I", data, off + 28)[0])
        off += entry_header + payload
    return archs


@pytest.fixture(scope="module")
def nvcc() -> str:
    return find_nvcc()


@pytest.fixture(scope="module")
def archs(nvcc: str) -> list[int]:
    have = listed_archs(nvcc)
    missing = [a for a in REQUIRED_ARCHS if a not in have]
    if missing:
        pytest.fail(f"this nvcc cannot target {', '.join(f'sm_{a}' for a in missing)} (it lists "
                    f"{sorted(have)}); the kernels must build for {REQUIRED_ARCHS}", pytrace=False)
    return list(REQUIRED_ARCHS) + [a for a in OPTIONAL_ARCHS if a in have]


@pytest.fixture(scope="module")
def builds(nvcc: str, archs: list[int], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Build]:
    """All compiles started at once and awaited together (a few seconds on 2 cores)."""
    out_dir = tmp_path_factory.mktemp("nvcc")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    common = ["-Werror", "all-warnings"]  # default C++ standard, as NVRTC
    jobs: dict[str, list[str]] = {}
    for source in sorted(loader.MODULES.values()):
        jobs[source] = [nvcc, "-fatbin", *common, *gencode, "--threads", "2", f"-I{CUDA_DIR}",
                        "-o", str(out_dir / f"{source}.fatbin"), str(CUDA_DIR / source)]
    for module in loader.MODULES:  # the text NVRTC gets: no include path needed
        inlined = out_dir / f"{module}.inlined.cu"
        inlined.write_text(loader.read_source(module, CUDA_DIR))
        jobs[f"{module} (inlined)"] = [nvcc, "-cubin", *common, "-arch=sm_80", "-o", str(out_dir / f"{module}.cubin"),
                                       str(inlined)]
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, cmd in jobs.items()}
    results = {}
    for label, proc in procs.items():
        _, err = proc.communicate(timeout=TIMEOUT_S)
        results[label] = Build(label, jobs[label], proc.returncode, err, Path(jobs[label][jobs[label].index("-o") + 1]))
    return results


def _check(build: Build) -> None:
    assert build.returncode == 0, f"{build.label} failed to compile:\n{' '.join(build.command)}\n{build.stderr}"


@pytest.mark.parametrize("source", sorted(loader.MODULES.values()))
def test_kernel_source_compiles_for_every_target(source: str, builds: dict[str, Build], archs: list[int]):
    build = builds[source]
    _check(build)
    assert fatbin_cubin_archs(build.output) == set(archs)   # a cubin for every target, read off the binary


@pytest.mark.parametrize("module", sorted(loader.MODULES))
def test_loader_text_compiles(module: str, builds: dict[str, Build]):
    _check(builds[f"{module} (inlined)"])


def test_every_cu_file_is_a_loader_module():
    assert sorted(p.name for p in CUDA_DIR.glob("*.cu")) == sorted(loader.MODULES.values())
