"""``vla-runtime bench``: per-phase latency, peak memory and efficiency of the dense engine.

Writes one JSON document. Absolute times are only meaningful on the machine they were taken on
(and count as product figures only from a GPU); the efficiency fields relate each phase's useful
FLOPs to the GEMM throughput measured in the same run, which travels better between machines.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.dense import DenseEngine, ModelInputs
from ..engine.timing import gemm_gflops
from ..models.checkpoint import load_checkpoint
from ..models.config import Pi05Config, preset
from ..models.flops import denoise_flops, prefill_flops, vision_flops
from ..models.pi05 import Pi05Model, init_random_
from ..progress import Progress, silent

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BenchSpec:
    preset: str = "pi05-small"
    checkpoint: str | None = None
    cameras: int = 3
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 5
    warmup: int = 1
    prompt_tokens: int = 64
    threads: int | None = None
    seed: int = 0
    gemm_size: int = 2048

    def validate(self) -> "BenchSpec":
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")
        if self.cameras < 1:
            raise ValueError("cameras must be >= 1")
        if self.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        return self


def peak_memory_mb(device: str) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def build_model(spec: BenchSpec, log=print) -> tuple[Pi05Model, str]:
    dtype = DTYPES[spec.dtype]
    if spec.checkpoint:
        log(f"loading checkpoint {spec.checkpoint} ...")
        ck = load_checkpoint(spec.checkpoint, dtype=dtype, device=spec.device)
        return ck.model, ck.content_hash
    cfg = preset(spec.preset)
    log(f"building {spec.preset} with random weights (seed {spec.seed}) ...")
    with torch.device(spec.device):
        model = Pi05Model(cfg)
    init_random_(model, seed=spec.seed)
    return model.to(dtype), f"random:{spec.preset}:seed{spec.seed}"


def synthetic_inputs(cfg: Pi05Config, cameras: int, prompt_tokens: int, seed: int) -> ModelInputs:
    """Fixed pseudo-random inputs of the right shapes (a real prompt is ~50-80 tokens)."""
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    tokens = torch.zeros(1, cfg.max_token_len, dtype=torch.int64)
    n = min(prompt_tokens, cfg.max_token_len)
    tokens[0, :n] = torch.randint(4, cfg.vocab_size, (n,), generator=g)
    mask = torch.zeros(1, cfg.max_token_len, dtype=torch.bool)
    mask[0, :n] = True
    return ModelInputs(images=torch.rand(1, cameras, 3, s, s, generator=g) * 2 - 1,
                       image_mask=torch.ones(1, cameras, dtype=torch.bool), tokens=tokens, token_mask=mask)


def run_bench(spec: BenchSpec, log=print, progress: Progress = silent) -> dict:
    spec.validate()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    load_before = os.getloadavg()
    model, model_id = build_model(spec, log)
    cfg = model.cfg
    if spec.cameras > cfg.num_cameras:
        raise ValueError(f"{spec.cameras} cameras requested, the model takes at most {cfg.num_cameras}")
    engine = DenseEngine(model, max_batch=1)
    inputs = synthetic_inputs(cfg, spec.cameras, spec.prompt_tokens, spec.seed)
    noise = engine.make_noise(1, torch.Generator().manual_seed(spec.seed))
    runs: list[dict[str, float]] = []
    with progress(f"calls ({spec.warmup} warm-up, {spec.repeats} timed)", spec.warmup + spec.repeats, "call") as bar:
        for i in range(spec.warmup + spec.repeats):
            out = engine.infer(inputs, noise=noise)
            if i >= spec.warmup:
                runs.append(out.times.as_dict())
            bar.set_postfix_str(f"last {out.times.total * 1e3:.0f} ms", refresh=False)
            bar.update()
    if not bool(torch.isfinite(out.actions).all()):
        raise RuntimeError("the engine produced non-finite actions")
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    prefix_tokens = spec.cameras * cfg.num_image_tokens + min(spec.prompt_tokens, cfg.max_token_len)
    flops = {"vision": vision_flops(cfg, spec.cameras), "prefill": prefill_flops(cfg, prefix_tokens),
             "denoise": denoise_flops(cfg, prefix_tokens)}
    flops["total"] = sum(flops.values())
    gemm = gemm_gflops(spec.gemm_size, DTYPES[spec.dtype], spec.device)
    achieved = {k: flops[k] / median[k] / 1e9 for k in flops}
    return {
        "spec": spec.__dict__,
        "model": model_id,
        "config": {"vision_depth": cfg.vision.depth, "vlm_depth": cfg.vlm.depth, "expert_depth": cfg.expert.depth,
                   "vlm_width": cfg.vlm.width, "expert_width": cfg.expert.width, "chunk": cfg.chunk_size,
                   "steps": cfg.num_steps, "prefix_tokens": prefix_tokens},
        "median_s": median,
        "all_s": runs,
        "useful_gflop": {k: v / 1e9 for k, v in flops.items()},
        "achieved_gflops": achieved,
        "gemm_gflops": gemm,
        "fraction_of_gemm": {k: v / gemm for k, v in achieved.items()},
        "peak_memory_mb": peak_memory_mb(spec.device),
        "machine": {"python": sys.version.split()[0], "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "device_name": torch.cuda.get_device_name() if spec.device.startswith("cuda") else platform.processor()},
    }


def write_json(result: dict, out: str | None) -> None:
    """Print the result as JSON and, with ``out``, also write it there (every bench does this)."""
    text = json.dumps(result, indent=2, default=str)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    print(text)
