"""Memory of N processes holding the same pi0.5 weights: private copies vs one shared mapping.

    python bench/shared_weights.py --out out/shared_weights.json          # pi05-small, 3 processes
    python bench/shared_weights.py --preset pi05-tiny --processes 2

Writes a pi05 checkpoint of the preset (random weights, public layout) into ``--work``, then per
mode starts ``--processes`` processes that each load it (``load_checkpoint``; ``share_weights``
in the shared mode, the runtime-layout file built once beforehand by a separate process), set up
a ``DenseEngine`` and run one call on synthetic inputs (every weight read). With all of them alive,
the parent reads each one's ``/proc/<pid>/smaps_rollup`` (Rss, Pss) and ``status`` (VmHWM) and,
when shared, the smaps of the weight file's mapping. Pss splits each shared page between the
processes that map it, so the sum of Pss is the memory the group really costs. JSON to stdout and
``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vla_runtime.models.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from vla_runtime.models.config import preset  # noqa: E402
from vla_runtime.models.pi05 import Pi05Model, init_random_  # noqa: E402
from vla_runtime.models.shared_weights import mapping_usage, weight_tensors  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _kib_fields(path: str, fields: tuple[str, ...]) -> dict[str, int]:
    """Selected ``Key:  N kB`` lines of a /proc file, in bytes."""
    out = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in fields:
            out[key] = int(rest.split()[0]) * 1024
    return out


def child(args: argparse.Namespace) -> None:
    """One runtime process: load, one call, report, stay alive until stdin closes."""
    from vla_runtime.engine.dense import DenseEngine, ModelInputs

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ck = load_checkpoint(args.checkpoint, dtype=_DTYPES[args.dtype], share_weights=args.share,
                         cache_dir=args.cache)
    load_s = time.perf_counter() - t0
    engine = DenseEngine(ck.model)
    cfg = ck.config
    g = torch.Generator().manual_seed(0)
    s, n = cfg.vision.image_size, cfg.num_cameras
    inputs = ModelInputs(images=torch.rand(1, n, 3, s, s, generator=g) * 2 - 1,
                         image_mask=torch.ones(1, n, dtype=torch.bool),
                         tokens=torch.randint(0, cfg.vocab_size, (1, args.prompt_tokens), generator=g),
                         token_mask=torch.ones(1, args.prompt_tokens, dtype=torch.bool))
    engine.infer(inputs, generator=g)
    weights = sum(t.nbytes for t in weight_tensors(ck.model).values())
    info = ck.shared
    print(json.dumps({"load_s": load_s, "weights_bytes": weights, "built": bool(info and info.built),
                      "file": str(info.path) if info else None}), flush=True)
    sys.stdin.read()


def run_group(args: argparse.Namespace, ckpt: Path, cache: Path, share: bool) -> dict:
    """Start the processes, measure them together, release them."""
    cmd = [sys.executable, __file__, "--child", "--checkpoint", str(ckpt), "--cache", str(cache),
           "--dtype", args.dtype, "--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens)]
    if share:
        cmd.append("--share")
        subprocess.run(cmd, input="", check=True, capture_output=True, text=True)  # builds the file, exits
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(args.processes)]
    try:
        ready = []
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"process {p.pid} exited with {p.wait()} before reporting")
            ready.append(json.loads(line))
        per = []
        for p, r in zip(procs, ready):  # every process alive and done with its call
            m = _kib_fields(f"/proc/{p.pid}/smaps_rollup", ("Rss", "Pss", "Pss_Anon", "Pss_File", "Shared_Clean"))
            m.update(_kib_fields(f"/proc/{p.pid}/status", ("VmHWM",)))
            if r["file"]:
                m["weights_mapping"] = mapping_usage(r["file"], p.pid)
            per.append(r | m)
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait()
    out = {"processes": per, "total_pss_bytes": sum(x["Pss"] for x in per),
           "total_rss_bytes": sum(x["Rss"] for x in per)}
    if share:
        out["weights_mapping_pss_total_bytes"] = sum(x["weights_mapping"]["Pss"] for x in per)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="pi05-small")
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--work", default=None, help="directory for the checkpoint and the weight cache (default: a temp dir)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--share", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="vla_shared_weights_"))
    ckpt, cache = work / "checkpoint", work / "weights"
    if not (ckpt / "model.safetensors").exists():
        save_checkpoint(init_random_(Pi05Model(preset(args.preset)), seed=0), ckpt)
    private = run_group(args, ckpt, cache, share=False)
    shared = run_group(args, ckpt, cache, share=True)
    weights = private["processes"][0]["weights_bytes"]
    result = {
        "preset": args.preset, "dtype": args.dtype, "processes": args.processes, "threads": args.threads,
        "checkpoint": str(ckpt), "weights_bytes": weights,
        "weights_file_bytes": Path(shared["processes"][0]["file"]).stat().st_size,
        "private": private, "shared": shared,
        "total_pss_saved_bytes": private["total_pss_bytes"] - shared["total_pss_bytes"],
        "total_pss_ratio": shared["total_pss_bytes"] / private["total_pss_bytes"],
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
