"""Parity and speed of our dense engine against LeRobot 0.6.1's pi05, side by side in one run.

Not part of CI (it needs LeRobot in its own Python 3.12 virtualenv and ~11 GB of memory).

    python bench/lerobot_parity.py --work /tmp/parity          # builds the venv if absent, then runs
    python bench/lerobot_parity.py --work /tmp/parity --reuse  # reuse DIR/ckpt + io from a previous run
    # the two layouts the closing checks use:
    python bench/lerobot_parity.py --work /tmp/parity-a --layers 2 --cameras 2 --empty-cameras 1 --prompt-len 37
    python bench/lerobot_parity.py --work /tmp/parity-b --vision-layers 1 --vlm-layers 3 --expert-layers 3 \
        --cameras 3 --prompt-len 60

Steps: (1) ``bench/lerobot_oracle.py`` runs under LeRobot: random full-width, reduced-depth
weights (per tower: ``--vision-layers``, ``--vlm-layers``, ``--expert-layers``, each defaulting to
``--layers``), ``save_pretrained`` into DIR/ckpt, fixed inputs and noise, ``sample_actions``
timed per phase, everything written to DIR; (2) this script loads DIR/ckpt with *our* loader,
runs our engine on the same tensors and noise, and writes DIR/parity.json.

Pass criterion (exit 0): the actions' max abs difference, and the prefix embeddings' and every
layer's prefix keys/values' max abs difference relative to the reference's max, each below its
threshold (1e-5 by default). With random weights the actions barely move when a prompt token
changes, so actions alone could not see a wrong text embedding; the intermediates can, and a
missing intermediate fails the check instead of being skipped.
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
from vla_runtime.engine.timing import gemm_gflops  # noqa: E402
from vla_runtime.models.flops import denoise_flops, prefill_flops, vision_flops  # noqa: E402

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
           "--vlm-layers", str(args.vlm_layers), "--expert-layers", str(args.expert_layers),
           "--vision-layers", str(args.vision_layers), "--cameras", str(args.cameras),
           "--empty-cameras", str(args.empty_cameras), "--prompt-len", str(args.prompt_len),
           "--seed", str(args.seed), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run(cmd, check=True, env=env)
    if args.verify_reload:  # LeRobot's own from_pretrained must reproduce the saved reference
        subprocess.run(cmd + ["--verify-ckpt"], check=True, env=env)


def relative_max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |theirs|: one scale-free figure per tensor."""
    return float((ours - theirs).abs().max() / theirs.abs().max())


def compare_intermediates(ck, inputs: ModelInputs, io: dict[str, torch.Tensor]) -> dict[str, float]:
    """Prefix embeddings and every VLM layer's keys/values at the valid prefix positions.

    LeRobot's prefix holds every camera slot and all 200 token positions; ours drops fully
    masked cameras and the trailing padding (identical attention, positions count valid tokens
    only), so the reference is cut to its valid positions before comparing.
    """
    valid = torch.cat([inputs.image_mask.repeat_interleave(ck.config.num_image_tokens, 1), inputs.token_mask], 1)[0]
    p = int(valid.sum())
    required = ["prefix_embs"] + [f"kv_{kind}_{layer}" for layer in range(ck.config.vlm.depth) for kind in "kv"]
    missing = [k for k in required if k not in io]
    if missing:
        raise SystemExit(f"io.safetensors lacks the intermediates {missing}: rerun the oracle (without --reuse)")
    image_tokens, _ = ck.model.embed_images(inputs.images)
    prefix = ck.model.build_prefix(image_tokens, inputs.image_mask, inputs.tokens, inputs.token_mask)
    if prefix.embeds.shape[1] != p:
        raise SystemExit(f"our prefix has {prefix.embeds.shape[1]} positions, LeRobot's {p} valid ones")
    out = {"prefix_embs": relative_max_diff(prefix.embeds[0], io["prefix_embs"][0][valid])}
    for layer, cache in enumerate(ck.model.caches):
        for kind in "kv":
            out[f"kv_{kind}_{layer}"] = relative_max_diff(getattr(cache, kind)[0, 0, :p], io[f"kv_{kind}_{layer}"][0, 0][valid])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/parity"))
    ap.add_argument("--venv", type=Path, default=Path("/tmp/lerobot/venv"))
    ap.add_argument("--layers", type=int, default=2, help="default depth of every tower")
    ap.add_argument("--vision-layers", type=int, default=None, help="SigLIP depth (default --layers)")
    ap.add_argument("--vlm-layers", type=int, default=None, help="VLM depth (default --layers)")
    ap.add_argument("--expert-layers", type=int, default=None, help="action expert depth (default --layers)")
    ap.add_argument("--cameras", type=int, default=3, help="real cameras (images given)")
    ap.add_argument("--empty-cameras", type=int, default=0, help="LeRobot's empty_cameras (blank, masked slots)")
    ap.add_argument("--prompt-len", type=int, default=40, help="valid prompt tokens (of 200)")
    ap.add_argument("--action-tol", type=float, default=1e-5, help="max abs action difference allowed")
    ap.add_argument("--rel-tol", type=float, default=1e-5,
                    help="max abs difference of prefix embeddings / keys / values relative to the reference's max")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse", action="store_true", help="skip the LeRobot run, reuse DIR")
    ap.add_argument("--verify-reload", action="store_true",
                    help="also reload DIR/ckpt with LeRobot's from_pretrained and require its actions bit-identical")
    args = ap.parse_args()
    for tower in ("vision", "vlm", "expert"):
        if getattr(args, f"{tower}_layers") is None:
            setattr(args, f"{tower}_layers", args.layers)
    work = args.work
    if not args.reuse:
        run_oracle(ensure_lerobot_venv(args.venv), work, args)

    torch.set_num_threads(args.threads)
    ck = load_checkpoint(work / "ckpt")
    io = load_file(str(work / "io.safetensors"))
    n = sum(1 for k in io if k.startswith("pixel_values_"))  # every slot LeRobot fed, empty ones included
    if n != ck.config.num_cameras:
        raise SystemExit(f"LeRobot fed {n} camera slots, our loader counts {ck.config.num_cameras} from config.json")
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
    intermediates = compare_intermediates(ck, inputs, io)  # the caches still hold the last call's prefix
    worst_name = max(intermediates, key=intermediates.get)
    checks = {
        "actions_max_abs_diff": {"value": float(diff.max()), "limit": args.action_tol},
        "intermediates_max_rel_diff": {"value": intermediates[worst_name], "limit": args.rel_tol, "worst": worst_name},
    }
    ok = all(c["value"] < c["limit"] for c in checks.values())
    ours = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    theirs = json.loads((work / "lerobot_timing.json").read_text())
    lr = theirs["median_s"]
    cfg = ck.config
    prefix = int(inputs.image_mask.sum()) * cfg.num_image_tokens + int(inputs.token_mask.sum())
    flops = {"vision": vision_flops(cfg, n), "prefill": prefill_flops(cfg, prefix), "denoise": denoise_flops(cfg, prefix)}
    gemm = gemm_gflops(2048, torch.float32, "cpu")
    result = {
        "checkpoint": str(work / "ckpt"), "content_hash": ck.content_hash, "layout": ck.layout,
        "depths": {"vision": cfg.vision.depth, "vlm": cfg.vlm.depth, "expert": cfg.expert.depth},
        "cameras": {"slots": n, "real": int(inputs.image_mask.sum()), "empty": n - int(inputs.image_mask.sum())},
        "prompt_tokens": int(inputs.token_mask.sum()), "threads": args.threads,
        "parity_ok": ok, "checks": checks,
        "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
        "reference_absmax": float(io["actions"].abs().max()),
        "intermediates_max_rel_diff": intermediates,
        "lerobot_embed_tokens_vs_lm_head": theirs["config"].get("embed_tokens_vs_lm_head_max_abs_diff"),
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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
