"""Regenerate the replay regression data in this directory: the input bag and the golden output.

    .venv/bin/python test/data/replay/make_golden.py            # refresh both bags + golden.json
    .venv/bin/python test/data/replay/make_golden.py --check    # only verify the checkpoint recipe

What is here and why:

- ``episode/``: a tiny recorded episode (synthetic scene at 56 px, cameras ``top`` and
  ``wrist`` as JPEG ``CompressedImage``, 30 frames at 30 Hz, so two policy calls at the default
  0.5 s call period), on the topics of ``config/sim.yaml``.
- ``golden/``: what ``vla-runtime replay`` produced from it with the demo checkpoint below,
  ``--seed 0``, stored as mcap (the tests write sqlite3, so both storages are exercised).
- ``golden.json``: the recipe and the checkpoint's content hash. The checkpoint itself (3 MB)
  is not committed: ``make_demo`` with a fixed seed rebuilds it byte for byte, and the test
  checks the hash first, so a change to the demo recipe is reported as such instead of as
  model drift.

Run this only for a *deliberate* change of the model's numbers (new kernel with different
rounding, preprocessing fix, ...): the golden is the regression reference, refreshing it
accepts whatever the code computes now. Review the drift the test reported first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PROFILE = REPO / "config" / "sim.yaml"
EPISODE = HERE / "episode"
GOLDEN = HERE / "golden"
RECIPE = HERE / "golden.json"

SEED = 0
CALL_PERIOD = 0.5


def demo_spec():
    from vla_runtime.commands.demo import DemoSpec

    return DemoSpec(preset="pi05-tiny", episodes=2, held_out=1, steps_per_episode=20, seed=0)


def build_checkpoint(root: Path) -> Path:
    """The demo checkpoint the golden was made with, built under ``root``; returns its directory."""
    from vla_runtime.commands.demo import make_demo

    return Path(make_demo(root, demo_spec(), log=lambda _: None)["checkpoint"])


def checkpoint_digest(ckpt: Path) -> str:
    """sha256 over *every* file of the checkpoint directory (weights, tokenizer, normalisation),
    in name order: the model's content hash covers the weights only."""
    h = hashlib.sha256()
    for f in sorted(p for p in ckpt.iterdir() if p.is_file()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return "sha256:" + h.hexdigest()


def write_episode(path: Path) -> None:
    from vla_runtime.io.bags import BagTopics, write_episode_bag
    from vla_runtime.nodes.profile import load_profile
    from vla_runtime.sim.scenes import SceneConfig, make_episode

    prof = load_profile(PROFILE)
    episode = make_episode(SceneConfig(image_size=56, cameras=("top", "wrist"), steps_per_episode=30,
                                       rate_hz=30.0, seed=0), episode_seed=0)
    topics = BagTopics(cameras={c.name: c.topic for c in prof.cameras}, joint_states=prof.joint_states_topics[0],
                       instruction=prof.instruction_topic)
    write_episode_bag(path, episode, topics, compressed=True, image_format="jpeg", jpeg_quality=85,
                      joint_names=prof.joint_names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only build the checkpoint twice and compare hashes")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from vla_runtime.cli import main as cli

    with tempfile.TemporaryDirectory() as tmp:
        a, b = build_checkpoint(Path(tmp) / "a"), build_checkpoint(Path(tmp) / "b")
        digest = checkpoint_digest(a)
        if checkpoint_digest(b) != digest:
            print("make_demo is not deterministic: two builds differ; a golden made from it would be useless",
                  file=sys.stderr)
            return 1
        print(f"checkpoint is reproducible: {digest}")
        if args.check:
            return 0
        for old in (EPISODE, GOLDEN):
            if old.exists():
                shutil.rmtree(old)
        write_episode(EPISODE)
        rc = cli(["replay", str(EPISODE), "--out", str(GOLDEN), "--profile", str(PROFILE), "--checkpoint", str(a),
                  "--seed", str(SEED), "--call-period", str(CALL_PERIOD), "--storage", "mcap"])
        if rc != 0:
            return rc
    RECIPE.write_text(json.dumps({"demo_spec": {k: v for k, v in vars(demo_spec()).items()},
                                  "checkpoint_digest": digest, "seed": SEED, "call_period": CALL_PERIOD,
                                  "profile": "config/sim.yaml"}, indent=2) + "\n")
    print(f"wrote {EPISODE}, {GOLDEN} and {RECIPE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
