"""``vla-runtime``: the ROS-free command line (run, replay, bench, build-cache, demo-data, inspect)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

from .models.checkpoint import CheckpointError
from .models.config import PRESETS
from .nodes.profile import CacheSpec
from .progress import bars, note

if TYPE_CHECKING:
    from .io.bags import BagTopics


def _log(msg: str) -> None:
    """Progress notes go to stderr (around any open bar); stdout keeps the result alone."""
    note(msg)


def _camera_topics(items: list[str]) -> dict[str, str]:
    """``name=/topic`` pairs, in the model's camera order."""
    out = {}
    for item in items:
        name, sep, topic = item.partition("=")
        if not sep or not name or not topic.startswith("/"):
            raise ValueError(f"--camera expects NAME=/topic, got {item!r}")
        out[name] = topic
    if not out:
        raise ValueError("at least one --camera NAME=/topic is needed")
    return out


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default=None, metavar="DIR",
                   help="a local LeRobot dataset (codebase v3.0) instead of bags: one episode per dataset episode")
    p.add_argument("--episodes", default=None, metavar="SEL",
                   help="with --dataset: which episodes, e.g. 0-49 or 3,7,10-12 (default: all)")
    p.add_argument("--feature", action="append", default=[], metavar="MODEL_KEY=DATASET_KEY",
                   help="with --dataset: the dataset feature for a model input (camera name, observation.state, "
                        "action); default: the checkpoint's config.json names (or the robot profile's dataset section)")


def _bench(args: argparse.Namespace) -> int:
    from .commands import summaries

    if args.stream:
        from .commands.stream_bench import StreamBenchSpec, run_stream_bench

        modes = tuple(m.strip() for m in args.stitch.split(",") if m.strip())
        spec = StreamBenchSpec(preset=args.preset, checkpoint=args.checkpoint, latency_ms=args.latency_ms,
                               duration_s=args.duration, control_hz=args.control_hz, n_execute=args.n_execute,
                               stream_horizon=None if args.stream_horizon == 0 else args.stream_horizon,
                               modes=modes, threads=args.threads, seed=args.seed)
        summaries.emit(run_stream_bench(spec, log=_log), args.out, summaries.stream)
        return 0
    if args.history:
        from .commands.history_bench import run_history_bench

        result = run_history_bench(args.preset, frames=args.history, calls=args.repeats,
                                   prompt_tokens=args.prompt_tokens, threads=args.threads, seed=args.seed, log=_log,
                                   progress=bars)
        summaries.emit(result, args.out, summaries.history)
        return 0
    if args.cache:
        from .commands.cache_bench import CacheBenchSpec, run_cache_bench

        if args.dataset:
            if not args.checkpoint or args.bags or args.camera:
                raise ValueError("--cache --dataset needs --checkpoint (cameras come from its config.json or "
                                 "--feature); drop --bags and --camera")
            source = {"dataset": args.dataset, "episodes": args.episodes, "features": tuple(args.feature)}
        else:
            if not (args.checkpoint and args.bags and args.camera):
                raise ValueError("--cache needs --checkpoint and --bags with --camera NAME=/topic, or --dataset")
            source = {"bags": args.bags, "cameras": _camera_topics(args.camera)}
        spec = CacheBenchSpec(checkpoint=args.checkpoint, repository=args.cache, **source,
                              call_period=args.call_period, rho_p=args.rho_p,
                              time_available_s=args.time_available, threads=args.threads, seed=args.seed)
        summaries.emit(run_cache_bench(spec, log=_log, progress=bars), args.out, summaries.cache_bench)
        return 0
    from .commands.bench import BenchSpec, run_bench

    spec = BenchSpec(**{f.name: getattr(args, f.name) for f in fields(BenchSpec)})
    summaries.emit(run_bench(spec, log=_log, progress=bars), args.out, summaries.bench)
    return 0


def _soak(args: argparse.Namespace) -> int:
    from .commands.bench import write_json
    from .commands.soak import run_soak

    write_json(run_soak(args.preset, calls=args.calls, history=args.history, seed=args.seed, dtype=args.dtype,
                        log=_log), args.out)
    return 0


def _build_cache_topics(args: argparse.Namespace) -> tuple[BagTopics, str]:
    """The bags' topics and the checkpoint: from ``--robot-profile`` (cameras, every joint-state
    topic with the joint names, instruction; the state assembled by name as the policy node
    does) or from the explicit topic flags (one joint-state topic, positions as published)."""
    from .io.bags import BagTopics, profile_topics
    from .nodes.profile import load_profile

    if args.robot_profile:
        given = [flag for flag, value in (("--camera", args.camera), ("--state-topic", args.state_topic),
                                          ("--instruction-topic", args.instruction_topic)) if value]
        if given:
            raise ValueError(f"--robot-profile names the topics; drop {', '.join(given)}")
        profile = load_profile(args.robot_profile)
        checkpoint = args.checkpoint or profile.engine.checkpoint
        if not checkpoint:
            raise ValueError(f"no checkpoint: pass --checkpoint or set engine.checkpoint in {args.robot_profile}")
        return profile_topics(profile, outcome=args.outcome_topic or None), checkpoint
    if not args.checkpoint:
        raise ValueError("--checkpoint is needed (or --robot-profile with engine.checkpoint)")
    return BagTopics(cameras=_camera_topics(args.camera), joint_states=args.state_topic or "/joint_states",
                     instruction=args.instruction_topic or "/instruction",
                     outcome=args.outcome_topic or None), args.checkpoint


def _build_cache(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .cache.builder import BuildConfig, admit_reference, build_repository_from
    from .cache.masks import even_groups
    from .cache.repository import ReferenceRepository
    from .engine.policy import Pi05Policy
    from .io.bags import list_episode_bags
    from .io.episode_sources import bag_refs, open_dataset

    if args.dataset:
        if args.bags or args.camera or args.state_topic or args.instruction_topic:
            raise ValueError("--dataset reads a LeRobot dataset: drop --bags and the topic flags")
        profile = None
        if args.robot_profile:
            from .nodes.profile import load_profile

            profile = load_profile(args.robot_profile)
        checkpoint = args.checkpoint or (profile.engine.checkpoint if profile else None)
        if not checkpoint:
            raise ValueError("--checkpoint is needed (or --robot-profile with engine.checkpoint)")
        policy, refs = open_dataset(args.dataset, checkpoint, profile, args.feature, args.episodes, log=_log)
    else:
        if not args.bags:
            raise ValueError("build-cache needs --bags or --dataset")
        if args.episodes or args.feature:
            raise ValueError("--episodes and --feature select from a --dataset")
        topics, checkpoint = _build_cache_topics(args)
        policy = Pi05Policy.from_checkpoint(checkpoint, camera_names=list(topics.cameras))
        refs = bag_refs(list_episode_bags(args.bags), topics)
    if args.admit:
        if args.mask_groups is not None:
            raise ValueError("--mask-groups sets a new repository's masks; one admitted into keeps its own")
        repo = ReferenceRepository.open(args.out, expect_checkpoint_hash=policy.checkpoint_hash)
        for ref in refs:
            admit_reference(policy, repo, ref, args.call_period, args.max_episodes_per_task, log=print)
        return 0
    from .commands import summaries

    groups = even_groups(policy.engine.model.cfg.num_steps, args.mask_groups)
    summary = build_repository_from(policy, policy.checkpoint_hash, refs, Path(args.out), args.call_period,
                                    BuildConfig(rho_n=args.rho_n, groups=groups, history_len=args.history),
                                    args.profile, tolerance=args.tolerance, adopt_profiled=args.adopt_profiled, log=_log,
                                    progress=bars)
    summaries.emit(summary.as_dict(), args.summary, summaries.build)
    return 0


def _demo_data(args: argparse.Namespace) -> int:
    from .commands.demo import DemoSpec, make_demo

    info = make_demo(args.out, DemoSpec(preset=args.preset, episodes=args.episodes, held_out=args.held_out,
                                        seed=args.seed, checkpoint_dtype=args.checkpoint_dtype), log=_log)
    print(json.dumps(info, indent=2))
    return 0


def _replay(args: argparse.Namespace) -> int:
    if args.dataset:
        from .commands.open_loop import OpenLoopSpec, open_loop_main

        if args.in_bag:
            raise ValueError("replay takes an input bag or --dataset, not both")
        spec = OpenLoopSpec(dataset=args.dataset, out=args.out, checkpoint=args.checkpoint, profile=args.profile,
                            repository=args.repository, episodes=args.episodes, features=args.feature,
                            call_period=args.call_period, n_execute=args.n_execute, seed=args.seed, rho_p=args.rho_p,
                            storage=args.storage, overwrite=args.overwrite, golden=args.golden,
                            tolerance=args.tolerance)
        return open_loop_main(spec, log=_log)
    from .commands.replay import ReplaySpec, replay_main

    if not args.in_bag:
        raise ValueError("replay needs an input bag (or --dataset DIR)")
    given = [flag for flag, value in (("--repository", args.repository), ("--n-execute", args.n_execute),
                                      ("--episodes", args.episodes), ("--feature", args.feature)) if value]
    if given:
        raise ValueError(f"{', '.join(given)}: only with --dataset (open-loop evaluation)")
    spec = ReplaySpec(in_bag=args.in_bag, out_bag=args.out, profile=args.profile or "config/sim.yaml",
                      checkpoint=args.checkpoint,
                      call_period=args.call_period, seed=args.seed, realtime=args.realtime, storage=args.storage,
                      overwrite=args.overwrite, golden=args.golden, tolerance=args.tolerance)
    return replay_main(spec, log=_log)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .commands.bench import write_json
    from .commands.run import RunSpec, run_pipeline

    spec = RunSpec(episode=Path(args.episode), profile=Path(args.profile),
                   checkpoint=Path(args.checkpoint) if args.checkpoint else None, processes=args.processes,
                   cache={"on": True, "off": False, "profile": None}[args.cache],
                   repository=Path(args.repository) if args.repository else None, call_period=args.call_period,
                   seed=args.seed, threads=args.threads)
    write_json(run_pipeline(spec, log=_log), args.out)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .nodes.profile import EngineSpec
    from .commands.eval import EvalSpec, evaluate

    band = lambda text: tuple(float(x) for x in text.split(","))  # noqa: E731
    spec = EvalSpec(checkpoint=args.checkpoint, out=args.out, tasks=tuple(args.task) if args.task else EvalSpec.tasks,
                    episodes=args.episodes, eval_seed=args.eval_seed, reference_episodes=args.reference_episodes,
                    reference_seed=args.reference_seed,
                    reference_tail_calls=(EvalSpec.reference_tail_calls if args.reference_tail_calls is None
                                          else args.reference_tail_calls),
                    pose_band=band(args.pose_band),
                    reference_band=band(args.reference_band), n_execute=args.n_execute, max_steps=args.max_steps,
                    processes=args.processes, modes=tuple(args.modes.split(",")), repository=args.repository,
                    reference_dataset=args.reference_dataset,
                    rho_p=args.rho_p, rho_n=args.rho_n, mask_groups=args.mask_groups,
                    profile_episodes=args.profile_episodes,
                    tolerance=args.tolerance, caches=tuple(args.caches.split(",")), seed=args.seed,
                    min_similarity=args.min_similarity, first_scene_floor=args.first_scene_floor,
                    max_end_matches=args.max_end_matches,
                    engine=EngineSpec(threads=args.threads))
    from .commands.eval import summary

    print(summary(evaluate(spec, log=_log, progress=bars), spec.out))
    return 0


def _eval_pool(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .commands.eval import pool, pool_table

    pooled = pool([Path(r) for r in args.runs], [Path(r) for r in args.other] if args.other else None,
                  args.other_mode)
    print(pool_table(pooled))
    if args.out:
        Path(args.out).write_text(json.dumps(pooled, indent=2, default=float))
    return 0


def _aloha_sim(args: argparse.Namespace) -> int:
    from .nodes.profile import EngineSpec
    from .commands.aloha_sim import AlohaRunSpec, run_aloha

    spec = AlohaRunSpec(out=args.out, profile=args.profile, checkpoint=args.checkpoint, preset=args.preset,
                        task=args.task, episodes=args.episodes, seed=args.seed, max_steps=args.max_steps,
                        n_execute=args.n_execute, processes=args.processes,
                        engine=EngineSpec(dtype=args.dtype, device=args.device, threads=args.threads))
    report = run_aloha(spec, log=_log)
    print(json.dumps(report["summary"], indent=2))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .commands.checkpoint_info import describe_checkpoint, format_text

    info = describe_checkpoint(args.checkpoint, compute_hash=args.hash, norm_asset=args.norm_asset)
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vla-runtime", description="Fast pi0.5 inference for robots.")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="per-phase latency, peak memory and efficiency of the dense engine (JSON)")
    b.add_argument("--preset", default="pi05-small", choices=sorted(PRESETS), help="model size with random weights")
    b.add_argument("--checkpoint", default=None, help="load this checkpoint instead of a random preset")
    b.add_argument("--cameras", type=int, default=3, help="number of camera images per call")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    b.add_argument("--repeats", type=int, default=5, help="timed calls (median reported)")
    b.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    b.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=64, help="valid prompt tokens")
    b.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--gemm-size", dest="gemm_size", type=int, default=2048, help="square matmul size for the throughput ceiling")
    b.add_argument("--out", default=None, help="write the JSON here (stdout gets a short summary; '-': the JSON on "
                                               "stdout instead)")
    b.add_argument("--cache", default=None, metavar="REPO",
                   help="dense vs cached on recorded episodes (--bags) with this reference repository")
    b.add_argument("--bags", default=None, help="with --cache: directory of held-out episode bags")
    _add_dataset_args(b)
    b.add_argument("--camera", action="append", default=[], metavar="NAME=/topic", help="with --cache: camera topics, in order")
    b.add_argument("--call-period", dest="call_period", type=float, default=0.5, help="seconds between policy calls")
    b.add_argument("--rho-p", dest="rho_p", type=float, default=None,
                   help="with --cache: fraction of visual tokens recomputed (default: the repository's profiled "
                        "fraction, else 0.4)")
    b.add_argument("--time-available", dest="time_available", type=float, default=1.0,
                   help="seconds between calls for window reconstruction (T_avl)")
    b.add_argument("--stream", action="store_true",
                   help="sync vs streaming control in simulated time, per stitching mode (stall rate, reaction latency, jerk)")
    b.add_argument("--latency-ms", dest="latency_ms", type=float, default=None,
                   help="with --stream: inject this call latency (default: each call's measured wall time)")
    b.add_argument("--duration", type=float, default=10.0, help="with --stream: simulated seconds per run")
    b.add_argument("--control-hz", dest="control_hz", type=float, default=50.0, help="with --stream: controller rate")
    b.add_argument("--n-execute", dest="n_execute", type=int, default=None,
                   help="with --stream: actions executed per chunk (default: half a chunk)")
    b.add_argument("--stitch", default="replace,blend,ensemble,freeze",
                   help="with --stream: comma-separated stitching modes to compare")
    b.add_argument("--stream-horizon", dest="stream_horizon", type=int, default=1,
                   help="with --stream: ticks of a chunk before the next one is due (1: continuous re-planning; "
                        "0: just in time at --n-execute)")
    b.add_argument("--history", type=int, default=0, metavar="K",
                   help="incremental vs full-recompute prefill of a K-frame observation history (--preset, --repeats)")
    b.set_defaults(func=_bench)

    c = sub.add_parser("build-cache", help="build a reference repository from recorded episodes (rosbag2 bags or a "
                                           "LeRobot v3.0 dataset)")
    c.add_argument("--checkpoint", default=None,
                   help="the checkpoint the repository is tied to (default with --robot-profile: its engine.checkpoint)")
    c.add_argument("--bags", default=None, help="a bag or a directory of episode bags")
    _add_dataset_args(c)
    c.add_argument("--out", required=True, help="repository directory (must not exist, unless --admit)")
    c.add_argument("--robot-profile", dest="robot_profile", default=None, metavar="YAML",
                   help="robot profile (config/<robot>.yaml): camera, joint-state and instruction topics and the joint "
                        "names, so the state is assembled by name from every joint-state topic as on the robot")
    c.add_argument("--camera", action="append", default=[], metavar="NAME=/topic",
                   help="camera topics, in model order (without --robot-profile)")
    c.add_argument("--state-topic", default=None, help="one joint-state topic, positions as published "
                                                        "(without --robot-profile; default /joint_states)")
    c.add_argument("--instruction-topic", default=None, help="default /instruction (without --robot-profile)")
    c.add_argument("--outcome-topic", default="/episode_outcome", help="'' when the bags have none")
    c.add_argument("--call-period", dest="call_period", type=float, default=0.5, help="seconds between policy calls")
    c.add_argument("--rho-n", dest="rho_n", type=float, default=0.5, help="fraction of expert neurons in the masks")
    c.add_argument("--mask-groups", dest="mask_groups", type=int, default=None, metavar="N",
                   help="Action Cache: N groups of consecutive denoising steps, each sharing one neuron mask and "
                        "opened by a dense anchor step (default 2, rMuscle's; 1 halves the anchors and gathers, "
                        "its mask covers each step less closely)")
    c.add_argument("--history", type=int, default=4, help="joint-history length L for retrieval")
    c.add_argument("--profile", type=int, default=0, metavar="N",
                   help="hold out N episodes per task to profile rho_p/rho_n (quality vs cost curve)")
    c.add_argument("--tolerance", type=float, default=0.05, help="max mean relative action deviation when profiling")
    c.add_argument("--adopt-profiled", dest="adopt_profiled", action="store_true",
                   help="store the masks at the profiled rho_n instead of --rho-n")
    c.add_argument("--admit", action="store_true", help="admit the bags online into an existing repository")
    c.add_argument("--max-episodes-per-task", dest="max_episodes_per_task", type=int, default=50,
                   help="bound on the repository with --admit (oldest evicted)")
    c.add_argument("--summary", default=None, help="write the build summary JSON here (stdout gets a short summary; "
                                                   "'-': the JSON on stdout instead)")
    c.set_defaults(func=_build_cache)

    k = sub.add_parser("soak", help="many consecutive calls in bf16 against fp32: NaN/Inf and drift (JSON)")
    k.add_argument("--preset", default="pi05-tiny", choices=sorted(PRESETS))
    k.add_argument("--calls", type=int, default=2000)
    k.add_argument("--history", type=int, default=4, help="observation history frames (state carried across calls)")
    k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--out", default=None)
    k.set_defaults(func=_soak)

    d = sub.add_parser("demo-data", help="write a demo checkpoint (random weights) and synthetic episode bags")
    d.add_argument("--out", required=True)
    d.add_argument("--preset", default="pi05-small", choices=sorted(PRESETS))
    d.add_argument("--episodes", type=int, default=8)
    d.add_argument("--held-out", dest="held_out", type=int, default=2)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--checkpoint-dtype", dest="checkpoint_dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the stored weights (bfloat16 for full pi05 on a 24 GB machine: float32 and its "
                        "copy while saving do not fit; the runtime's engine.dtype is separate)")
    d.set_defaults(func=_demo_data)

    rp = sub.add_parser("replay", help="run the policy over a recorded episode bag at its recorded timing; write "
                                       "chunks and latencies to a bag, optionally compare with a golden bag (JSON); "
                                       "with --dataset: open-loop errors against a LeRobot dataset's actions")
    rp.add_argument("in_bag", nargs="?", default=None, help="input episode bag (rosbag2 directory, .db3 or .mcap)")
    rp.add_argument("--out", required=True, help="output bag (must not exist, unless --overwrite); with --dataset: "
                                                 "a folder for open_loop.json and one chunk bag per episode")
    rp.add_argument("--profile", default=None, help="robot profile YAML: topics, joints, checkpoint (bags: default "
                                                    "config/sim.yaml; --dataset: optional, its dataset section names "
                                                    "the features)")
    _add_dataset_args(rp)
    rp.add_argument("--repository", default=None, help="with --dataset: run cached beside dense with this reference "
                                                       "repository (same noise): hit rate, fallbacks, cached errors")
    rp.add_argument("--rho-p", dest="rho_p", type=float, default=None,
                    help="with --repository: Context Cache fraction (default: the repository's profiled fraction, "
                         "else 0.4)")
    rp.add_argument("--n-execute", dest="n_execute", type=int, default=None,
                    help="with --dataset: chunk rows scored per call (default: the frames until the next call)")
    rp.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the profile's engine.checkpoint)")
    rp.add_argument("--call-period", dest="call_period", type=float, default=0.5,
                    help="seconds of bag time between policy calls")
    rp.add_argument("--seed", type=int, default=0, help="noise seed: call n uses seed * 1000003 + n, like the policy node")
    pace = rp.add_mutually_exclusive_group()
    pace.add_argument("--as-fast-as-possible", dest="realtime", action="store_false", default=False,
                      help="run calls back to back (default)")
    pace.add_argument("--realtime", dest="realtime", action="store_true", help="sleep to keep the bag's timing")
    rp.add_argument("--storage", default="sqlite3", choices=["sqlite3", "mcap"], help="output bag storage")
    rp.add_argument("--overwrite", action="store_true", help="replace an existing output bag")
    rp.add_argument("--golden", default=None, help="regression mode: compare the chunks with this bag's (exit 2 on drift); "
                                                   "with --dataset: an earlier --out folder")
    rp.add_argument("--tolerance", type=float, default=1e-4, help="with --golden: max abs action difference")
    rp.set_defaults(func=_replay)

    rn = sub.add_parser("run", help="the vision, cache-manager and policy stages without ROS (3 processes or 1) "
                                    "over a recorded episode bag: per-call source, reference and latency (JSON)")
    rn.add_argument("episode", help="episode bag (rosbag2 directory) that plays the robot")
    rn.add_argument("--profile", default="config/sim.yaml", help="robot profile YAML: topics, joints, checkpoint, cache")
    rn.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the profile's engine.checkpoint)")
    rn.add_argument("--processes", type=int, default=3, choices=[1, 3],
                    help="3: one OS process per stage, as the nodes run (default); 1: all stages in this process")
    rn.add_argument("--cache", default="profile", choices=["on", "off", "profile"],
                    help="muscle-memory cache: on, off, or as the profile says (default)")
    rn.add_argument("--repository", default=None, help="reference repository (overrides the profile's; turns the cache on)")
    rn.add_argument("--call-period", dest="call_period", type=float, default=0.5, help="seconds of bag time between calls")
    rn.add_argument("--seed", type=int, default=0, help="noise seed: call n uses seed * 1000003 + n, like the policy node")
    rn.add_argument("--threads", type=int, default=None, help="torch threads per process")
    rn.add_argument("--out", default=None, help="also write the JSON here")
    rn.set_defaults(func=_run)

    ev = sub.add_parser("eval", help="closed-loop success on Meta-World, dense vs cached on the same seeds: "
                                     "table, JSON and PNG in --out")
    ev.add_argument("--checkpoint", required=True, help="a checkpoint trained for the Meta-World tasks")
    ev.add_argument("--out", required=True, help="folder for eval.json, eval.md, eval.png (and references/)")
    ev.add_argument("--task", action="append", default=None, help="Meta-World task (repeat; default: the five trained)")
    ev.add_argument("--episodes", type=int, default=50, help="evaluation episodes per task")
    ev.add_argument("--eval-seed", dest="eval_seed", type=int, default=100_000, help="first evaluation seed")
    ev.add_argument("--reference-episodes", dest="reference_episodes", type=int, default=10,
                    help="dense episodes per task recorded to build the repository (disjoint seeds)")
    ev.add_argument("--reference-seed", dest="reference_seed", type=int, default=50_000, help="first reference seed")
    ev.add_argument("--reference-tail-calls", dest="reference_tail_calls", type=int, default=None,
                    help="policy calls recorded past each reference's success (the robot at the goal): an episode "
                         "near the goal then matches more than the references' last call (default 5; 0: up to "
                         "the success)")
    ev.add_argument("--pose-band", dest="pose_band", default="0,1",
                    help="inner,outer normalised band of the evaluation object poses (e.g. 0.7,1 = held out)")
    ev.add_argument("--reference-band", dest="reference_band", default="0,1", help="band of the reference poses")
    ev.add_argument("--n-execute", dest="n_execute", type=int, default=4, help="actions executed per policy call")
    ev.add_argument("--max-steps", dest="max_steps", type=int, default=500,
                    help="environment steps per episode (500: Meta-World's own episode length)")
    ev.add_argument("--processes", type=int, default=1, choices=[1, 3], help="pipeline in 1 process or 3")
    ev.add_argument("--modes", default="dense,cached",
                    help="comma-separated: dense, cached, resampled (the dense policy on other noise: how many "
                         "outcomes other noise alone changes, the scale for cached vs dense)")
    ev.add_argument("--repository", default=None, help="an existing reference repository (skips recording references)")
    ev.add_argument("--reference-dataset", dest="reference_dataset", default=None, metavar="DIR",
                    help="build the repository from this LeRobot dataset's episodes of the evaluated tasks (e.g. "
                         "metaworld_demos --format lerobot) instead of recording dense reference episodes")
    ev.add_argument("--rho-p", dest="rho_p", type=float, default=None,
                    help="Context Cache recompute fraction (default: profiled when the repository is built here, "
                         "else the one a given repository was profiled at, else 0.4)")
    ev.add_argument("--rho-n", dest="rho_n", type=float, default=None,
                    help="Action Cache neuron fraction of the repository built here (default: profiled; "
                         "--repository keeps its own)")
    ev.add_argument("--mask-groups", dest="mask_groups", type=int, default=None, metavar="N",
                    help="Action Cache mask groups of the repository built here (build-cache --mask-groups; "
                         "default 2; --repository keeps its own)")
    ev.add_argument("--profile-episodes", dest="profile_episodes", type=int, default=2,
                    help="reference episodes per task replayed to profile rho_p/rho_n")
    ev.add_argument("--tolerance", type=float, default=0.05,
                    help="mean relative action deviation the profiled ratios may cost")
    ev.add_argument("--caches", default="context,action",
                    help="comma-separated halves of the cache the cached mode forces on: context, action "
                         "(ablations); or auto: what the runtime's auto picks on this machine, as on a robot")
    ev.add_argument("--min-similarity", dest="min_similarity", type=float, default=CacheSpec.min_similarity,
                    help="fallback threshold of every retrieval (cache.min_similarity)")
    ev.add_argument("--first-scene-floor", dest="first_scene_floor", action="store_true",
                    help="also fall back when an episode's first scene is less similar to the repository than "
                         "any reference's first scene is to the others (cache.first_scene_floor)")
    ev.add_argument("--max-end-matches", dest="max_end_matches", type=int, default=None,
                    help="fall back when an episode matches references' last calls more often than this "
                         "(past the references; cache.max_end_matches; 0: no limit). Default: no limit for "
                         f"references recorded here past their success, else {CacheSpec.max_end_matches}")
    ev.add_argument("--seed", type=int, default=0,
                    help="policy noise seed (both modes draw the same noise on an episode seed; another --seed "
                         "draws other noise)")
    ev.add_argument("--threads", type=int, default=None, help="torch threads per pipeline process")
    ev.set_defaults(func=_eval)

    ep = sub.add_parser("eval-pool", help="dense against cached (or another mode) seed by seed over several eval "
                                          "runs of one checkpoint: counts and the paired difference with its interval")
    ep.add_argument("runs", nargs="+", help="eval output folders (their dense episodes)")
    ep.add_argument("--other", nargs="+", default=None,
                    help="folders of the other side (default: the same runs)")
    ep.add_argument("--other-mode", dest="other_mode", default="cached", choices=["cached", "dense", "resampled"],
                    help="which episodes of the other side")
    ep.add_argument("--out", default=None, help="write the pooled comparison as JSON here")
    ep.set_defaults(func=_eval_pool)

    al = sub.add_parser("aloha-sim", help="the ALOHA profile in closed loop on gym-aloha: cameras, 14-dim actions, "
                                          "safety and per-call latency against the chunk's duration (JSON)")
    al.add_argument("--out", required=True, help="folder for aloha.json (and the random checkpoint)")
    al.add_argument("--profile", default=None, help="robot profile YAML (default: config/aloha.yaml)")
    al.add_argument("--checkpoint", default=None, help="an ALOHA checkpoint (default: random weights of --preset)")
    al.add_argument("--preset", default="pi05-small", choices=sorted(PRESETS), help="model of the random checkpoint")
    al.add_argument("--task", default="transfer_cube", choices=["transfer_cube", "insertion"])
    al.add_argument("--episodes", type=int, default=2)
    al.add_argument("--seed", type=int, default=0, help="object pose seed of the first episode")
    al.add_argument("--max-steps", dest="max_steps", type=int, default=400, help="50 Hz steps per episode")
    al.add_argument("--n-execute", dest="n_execute", type=int, default=25, help="ticks executed per call")
    al.add_argument("--processes", type=int, default=3, choices=[1, 3], help="pipeline in 1 process or 3")
    al.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    al.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    al.add_argument("--threads", type=int, default=None, help="torch threads per pipeline process")
    al.set_defaults(func=_aloha_sim)

    i = sub.add_parser("inspect", help="validate a checkpoint and print its architecture")
    i.add_argument("checkpoint")
    i.add_argument("--hash", action="store_true", help="also compute the content hash (reads every byte)")
    i.add_argument("--json", action="store_true", help="print JSON (for tools and CI) instead of text")
    i.add_argument("--norm-asset", dest="norm_asset", default=None,
                   help="openpi checkpoints: the assets/<id> whose norm_stats.json to report")
    i.set_defaults(func=_inspect)

    from .ipc.bench import bench_ipc_main

    r = sub.add_parser("bench-ipc", help="ring-buffer hand-offs between processes for one prefix slot: "
                                         "torn reads, latency (JSON)")
    r.add_argument("--preset", default="pi05-small", choices=sorted(PRESETS), help="model whose prefix slot is sent")
    r.add_argument("--prefix-len", dest="prefix_len", type=int, default=None,
                   help="prefix tokens per slot (default: the preset's maximum)")
    r.add_argument("--handoffs", type=int, default=100_000, help="stress phase: accepted hand-offs over all readers")
    r.add_argument("--readers", type=int, default=2, help="stress phase: reader processes")
    r.add_argument("--slots", type=int, default=3, help="stress phase: ring slots (fewer = more contention)")
    r.add_argument("--latency-handoffs", dest="latency_handoffs", type=int, default=5_000,
                   help="latency phase: hand-offs with a paced writer and one reader")
    r.add_argument("--period-ms", dest="period_ms", type=float, default=2.0, help="latency phase: writer period")
    r.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    r.add_argument("--out", default=None, help="also write the JSON here")
    r.set_defaults(func=bench_ipc_main)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"vla-runtime {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
