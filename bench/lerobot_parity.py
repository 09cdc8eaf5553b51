"""Parity and speed of our dense engine against LeRobot 0.6.1's pi05, side by side in one run.

Not part of CI (it needs LeRobot in its own Python 3.12 virtualenv and ~11 GB of memory).

    python bench/lerobot_parity.py --work /tmp/parity          # builds the venv if absent, then runs
    python bench/lerobot_parity.py --work /tmp/parity --reuse  # reuse DIR/ckpt + io from a previous run

Steps: (1) ``bench/lerobot_oracle.py`` runs under LeRobot: random full-width, reduced-depth
weights (2+2+2 layers by default), ``save_pretrained`` into DIR/ckpt, fixed inputs and noise,
``sample_actions`` timed per phase, everything written to DIR; (2) this script loads DIR/ckpt with
*our* loader, runs our engine on the same tensors and noise, and writes DIR/parity.json with the
max abs difference and both engines' per-phase medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vla_runtime.engine.dense import DenseEngine, ModelInputs  # noqa: E402
from vla_runtime.models.checkpoint import load_checkpoint  # noqa: E402
from vla_runtime.tools.bench import gemm_gflops  # noqa: E402
from vla_runtime.tools.flops import denoise_flops, prefill_flops, vision_flops  # noqa: E402

LEROBOT_PY = "/root/.pyenv/versions/3.12.1/bin/python3.12"


def ensure_lerobot_venv(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if py.exists():
        return py
    print(f"creating LeRobot virtualenv in {venv} (about 5 minutes, 5.3 GB) ...", flush=True)
    subprocess.run([LEROBOT_PY, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "lerobot[pi]==0.6.1"], check=True)
    return py


def run_oracle(py: Path, work: Path, args: argparse.Namespace) -> None:
    cmd = [str(py), str(ROOT / "bench" / "lerobot_oracle.py"), "--out", str(work),
           "--vlm-layers", str(args.layers), "--expert-layers", str(args.layers), "--vision-layers", str(args.layers),
           "--cameras", str(args.cameras), "--seed", str(args.seed), "--repeats", str(args.repeats),
           "--threads", str(args.threads)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run(cmd, check=True, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/parity"))
    ap.add_argument("--venv", type=Path, default=Path("/tmp/lerobot/venv"))
    ap.add_argument("--layers", type=int, default=2, help="depth of SigLIP, VLM and expert")
    ap.add_argument("--cameras", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse", action="store_true", help="skip the LeRobot run, reuse DIR")
    args = ap.parse_args()
    work = args.work
    if not args.reuse:
        run_oracle(ensure_lerobot_venv(args.venv), work, args)

    torch.set_num_threads(args.threads)
    ck = load_checkpoint(work / "ckpt")
    io = load_file(str(work / "io.safetensors"))
    n = args.cameras
    inputs = ModelInputs(
        # The oracle hands LeRobot's sample_actions these exact tensors; we feed ours the same.
        images=torch.stack([io[f"pixel_values_{i}"] for i in range(n)], dim=1),
        image_mask=io["image_mask"][:, :n].bool(),
        tokens=io["tokens"], token_mask=io["token_mask"].bool(),
    )
    engine = DenseEngine(ck.model)
    runs = []
    for i in range(args.repeats + 1):
        out = engine.infer(inputs, noise=io["noise"])
        if i:
            runs.append(out.times.as_dict())
    diff = (out.actions - io["actions"]).abs()
    # With random weights the actions depend only weakly on the prefix, so compare the
    # intermediates too: prefix embeddings and every layer's keys/values at the valid positions.
    valid = torch.cat([inputs.image_mask.repeat_interleave(ck.config.num_image_tokens, 1), inputs.token_mask], 1)[0]
    p = int(valid.sum())
    intermediates = {}
    if "prefix_embs" in io:
        image_tokens, _ = ck.model.embed_images(inputs.images)
        prefix = ck.model.build_prefix(image_tokens, inputs.image_mask, inputs.tokens, inputs.token_mask)
        intermediates["prefix_embs"] = float((prefix.embeds[0] - io["prefix_embs"][0][valid]).abs().max())
    for layer, cache in enumerate(ck.model.caches):
        for kind in ("k", "v"):
            key = f"kv_{kind}_{layer}"
            if key in io:
                theirs_kv = io[key][0, 0][valid]
                intermediates[key] = float((getattr(cache, kind)[0, 0, :p] - theirs_kv).abs().max() / theirs_kv.abs().max())
    ours = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    theirs = json.loads((work / "lerobot_timing.json").read_text())
    lr = theirs["median_s"]
    cfg = ck.config
    prefix = n * cfg.num_image_tokens + int(inputs.token_mask.sum())
    flops = {"vision": vision_flops(cfg, n), "prefill": prefill_flops(cfg, prefix), "denoise": denoise_flops(cfg, prefix)}
    gemm = gemm_gflops(2048, torch.float32, "cpu")
    result = {
        "checkpoint": str(work / "ckpt"), "content_hash": ck.content_hash, "layout": ck.layout,
        "layers": args.layers, "cameras": n, "threads": args.threads,
        "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
        "reference_absmax": float(io["actions"].abs().max()),
        "parity_ok_1e-4": bool(diff.max() < 1e-4),
        "intermediates_max_abs_diff": intermediates,
        "median_s": {"ours": ours, "lerobot": {k: lr[k] for k in ("vision", "prefill", "denoise", "total")}},
        "speedup": {k: lr[k] / ours[k] for k in ("vision", "prefill", "denoise", "total")},
        "useful_gflop": {k: v / 1e9 for k, v in flops.items()},
        "fraction_of_gemm": {
            "ours": {k: flops[k] / ours[k] / 1e9 / gemm for k in flops},
            "lerobot": {k: flops[k] / lr[k] / 1e9 / gemm for k in flops},
        },
        "gemm_gflops": gemm,
        "loadavg": os.getloadavg(),
        "lerobot_loadavg": theirs.get("loadavg"),
        "torch": {"ours": torch.__version__, "lerobot": theirs["config"].get("torch")},
    }
    (work / "parity.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if result["parity_ok_1e-4"] else 1


if __name__ == "__main__":
    sys.exit(main())
