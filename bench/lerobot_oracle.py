#!/usr/bin/env python
"""LeRobot pi0.5 oracle: reference outputs and CPU timings from LeRobot's own PI05Policy.

This script is a benchmark/parity tool. It runs under the *LeRobot* virtualenv
(lerobot 0.6.1, `pip install "lerobot[pi]==0.6.1"`, Python >= 3.12), never under
vla_runtime's environment, and vla_runtime never imports it.

What it does:
  1. Builds `PI05Policy(PI05Config(device="cpu"))` offline with random, seeded weights at
     full width but reduced depth (VLM / action expert / SigLIP layer counts from the CLI).
  2. Perturbs every floating parameter with seeded noise so that no weight stays at its
     trivial init (zero norms, zero adaRMS dense, zero padding embedding row, ...). Tensors
     LeRobot keeps separate stay separate: the text embedding and the LM head are perturbed
     independently and saved as they are, so a loader reading the wrong one is caught.
  3. Saves the policy and its LeRobot pre/post processors (with seeded quantile stats) to
     DIR/ckpt, so the directory looks like a trained LeRobot pi05 checkpoint, and describes
     the saved files in DIR/ckpt_files.txt.
  4. Runs `policy.model.sample_actions(...)` on deterministic inputs and fixed noise,
     `--repeats` times, timing the whole call and the vision / prefill / denoise phases.
  5. Writes DIR/io.safetensors (inputs, raw model output and per-phase intermediates),
     DIR/processor_io.json (state normalisation / prompt construction reference) and
     DIR/lerobot_timing.json (median and all timings, versions, load, peak RSS).

Example:
  HF_HUB_OFFLINE=1 /tmp/lerobot/venv/bin/python bench/lerobot_oracle.py --out /tmp/parity \
      --vlm-layers 2 --expert-layers 2 --vision-layers 2 --cameras 2 --empty-cameras 1 \
      --prompt-len 37 --seed 0 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

# Everything is built from random weights; nothing may be fetched from the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

CAMERA_KEYS = (
    "observation.images.base_0_rgb",
    "observation.images.left_wrist_0_rgb",
    "observation.images.right_wrist_0_rgb",
)
STATE_DIM = 32
ACTION_DIM = 32
IMAGE_SIZE = 224
TOKEN_LEN = 200  # PI05Config.tokenizer_max_length
PROMPT_LEN = 40  # default number of valid (unpadded) prompt tokens in the synthetic prompt (--prompt-len)
PERTURB_STD = 0.02
TASK = "pick up the red block and put it in the bowl"


def log(msg: str) -> None:
    print(f"[oracle {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # ru_maxrss is KiB on Linux


# --------------------------------------------------------------------------------------
# Reduced-depth build
# --------------------------------------------------------------------------------------
def patch_depths(vlm_layers: int, expert_layers: int, vision_layers: int) -> None:
    """Make PI05Pytorch build a full-width model with the given layer counts.

    PI05Config has no depth settings: the variants are fixed names ("gemma_2b" for the VLM,
    "gemma_300m" for the expert), so two patches of lerobot.policies.pi05.modeling_pi05 are
    needed, both applied before the policy is constructed:

    * `get_gemma_config(variant)` returns the width/depth/heads of a Gemma variant. Its
      `depth` becomes `text_config.num_hidden_layers` of the PaliGemma LM and
      `num_hidden_layers` of the expert's GemmaConfig in PaliGemmaWithExpertModel.__init__.
      We wrap it and override only `depth`, keeping every width unchanged.
    * The SigLIP depth is not derived from get_gemma_config at all:
      PaliGemmaWithExpertModel.__init__ calls `CONFIG_MAPPING["paligemma"]()`, whose
      PaliGemmaConfig.__post_init__ creates the default SigLIP config (27 layers), and then
      only overrides image_size / intermediate_size / projection_dim. We replace the module's
      `CONFIG_MAPPING` name with a thin mapping whose "paligemma" factory sets
      `vision_config.num_hidden_layers` on the freshly built config.

    Note: config.json does not record depths, so a reduced checkpoint's depths must be read
    off the tensor names (layers.N) when loading it elsewhere.
    """
    import lerobot.policies.pi05.modeling_pi05 as m

    depth_by_variant = {"gemma_2b": vlm_layers, "gemma_300m": expert_layers}
    orig_get_gemma_config = m.get_gemma_config

    def get_gemma_config_reduced(variant: str):
        cfg = orig_get_gemma_config(variant)
        cfg.depth = depth_by_variant[variant]
        return cfg

    m.get_gemma_config = get_gemma_config_reduced

    class _ConfigMappingWithSiglipDepth:
        def __init__(self, base):
            self._base = base

        def __getitem__(self, key):
            factory = self._base[key]
            if key != "paligemma":
                return factory

            def make_paligemma_config(*args, **kwargs):
                cfg = factory(*args, **kwargs)
                cfg.vision_config.num_hidden_layers = vision_layers
                return cfg

            return make_paligemma_config

    m.CONFIG_MAPPING = _ConfigMappingWithSiglipDepth(m.CONFIG_MAPPING)


def build_policy(args):
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    input_features = {
        key: PolicyFeature(type=FeatureType.VISUAL, shape=(3, IMAGE_SIZE, IMAGE_SIZE))
        for key in CAMERA_KEYS[: args.cameras]
    }
    input_features["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))
    output_features = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))}
    config = PI05Config(
        device="cpu",
        dtype="float32",
        empty_cameras=args.empty_cameras,  # added to input_features as empty_camera_<i> by LeRobot itself
        input_features=input_features,
        output_features=output_features,
        push_to_hub=False,
    )

    torch.manual_seed(args.seed)  # random but reproducible init
    policy = PI05Policy(config)
    policy.eval()
    return policy


@torch.no_grad()
def perturb_parameters(policy, seed: int, std: float) -> int:
    """Add std * N(0, 1) to every floating parameter (in named_parameters order, seeded).

    The default init leaves many weights trivial: RMSNorm weights are zeros (so (1 + w) == 1),
    the expert's adaRMS `dense` weights are zero-initialised (so scale/shift/gate would be
    input-independent), the padding row 0 of embed_tokens is zero, LayerNorm weights are ones.
    A parity test against such weights would not notice e.g. a missing (1 + w) or a swapped
    scale/shift chunk. Perturbing everything makes each of these paths matter.
    """
    gen = torch.Generator().manual_seed(seed)
    n = 0
    for _, p in policy.named_parameters():
        if p.is_floating_point():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
            n += 1
    # embed_tokens and lm_head are perturbed independently and left that way: LeRobot's
    # from_pretrained loads the file's embed_tokens over its lm_head copy, so the saved file
    # reloads to this exact model (--verify-ckpt checks it) and a consumer that embeds text with
    # lm_head instead differs visibly in prefix_embs and every layer's keys/values.
    return n


# --------------------------------------------------------------------------------------
# Processors and normalisation stats
# --------------------------------------------------------------------------------------
def make_dataset_stats(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Seeded, sane per-dimension stats in the LeRobot dataset format (q01 < q10 < ... < q99)."""
    gen = torch.Generator().manual_seed(seed + 2)
    stats = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        mean = torch.randn(dim, generator=gen) * 0.5
        std = 0.2 + torch.rand(dim, generator=gen)
        stats[key] = {
            "mean": mean,
            "std": std,
            "min": mean - 3.0 * std,
            "max": mean + 3.0 * std,
            "q01": mean - 2.3 * std,
            "q10": mean - 1.3 * std,
            "q50": mean + 0.05 * std,
            "q90": mean + 1.3 * std,
            "q99": mean + 2.3 * std,
            "count": torch.tensor([1000]),
        }
    return stats


def make_processors(config, stats):
    """Build LeRobot's pi05 pre/post processors (processor_pi05.make_pi05_pre_post_processors).

    Its TokenizerProcessorStep loads the gated "google/paligemma-3b-pt-224" tokenizer in
    __post_init__, which is impossible offline. We stand in a placeholder for
    transformers.AutoTokenizer while building: the step still records
    tokenizer_name="google/paligemma-3b-pt-224" in the saved JSON (get_config only keeps the
    name), so the saved files are identical to a real checkpoint's. The placeholder cannot
    tokenize; the oracle feeds pre-tokenized ids to the model instead.
    """
    import lerobot.processor.tokenizer_processor as tp
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors

    class _NoTokenizer:
        name = "placeholder (offline; real one is google/paligemma-3b-pt-224)"

        def __call__(self, *a, **k):
            raise RuntimeError("tokenizer unavailable offline")

    class _AutoTokenizerStub:
        @staticmethod
        def from_pretrained(name, *a, **k):
            return _NoTokenizer()

    real = tp.AutoTokenizer
    tp.AutoTokenizer = _AutoTokenizerStub
    try:
        return make_pi05_pre_post_processors(config, dataset_stats=stats)
    finally:
        tp.AutoTokenizer = real


def describe_ckpt(ckpt: Path, out_txt: Path) -> None:
    from safetensors import safe_open

    lines = []
    for f in sorted(ckpt.iterdir()):
        lines.append(f"{f.name}\t{f.stat().st_size} bytes")
    for f in sorted(ckpt.iterdir()):
        if f.suffix == ".json" and f.name != "config.json":
            lines += ["", f"===== {f.name} =====", f.read_text().rstrip()]
        elif f.suffix == ".safetensors" and f.name != "model.safetensors":
            lines += ["", f"===== {f.name} (keys, dtype, shape) ====="]
            with safe_open(str(f), "pt") as sf:
                for k in sorted(sf.keys()):
                    t = sf.get_tensor(k)
                    lines.append(f"{k}\t{t.dtype}\t{list(t.shape)}")
    cfg = ckpt / "config.json"
    if cfg.exists():
        lines += ["", "===== config.json =====", cfg.read_text().rstrip()]
    with safe_open(str(ckpt / "model.safetensors"), "pt") as sf:
        keys = list(sf.keys())
    lines += ["", f"===== model.safetensors: {len(keys)} tensors (first 5 / last 5 keys) ====="]
    lines += sorted(keys)[:5] + ["..."] + sorted(keys)[-5:]
    out_txt.write_text("\n".join(lines) + "\n")


@torch.no_grad()
def processor_reference(preprocessor, postprocessor, actions: torch.Tensor, seed: int) -> dict:
    """Run LeRobot's state-normalise + prompt-building steps and the full postprocessor.

    Gives a reference for (a) quantile normalisation of a raw state, its 256-bin
    discretisation and the exact prompt string, and (b) unnormalisation of the model's
    actions. Tokenisation itself is skipped (no tokenizer offline).
    """
    from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep
    from lerobot.processor import NormalizerProcessorStep, create_transition
    from lerobot.lerobot_types import TransitionKey

    gen = torch.Generator().manual_seed(seed + 3)
    stats = preprocessor_stats(preprocessor)
    q01, q99 = stats["observation.state.q01"], stats["observation.state.q99"]
    # Raw state mostly inside [q01, q99], a few dims outside (to show there is no clipping).
    u = torch.rand(STATE_DIM, generator=gen) * 1.2 - 0.1
    state_raw = (q01 + u * (q99 - q01))[None].float()

    transition = create_transition(
        observation={"observation.state": state_raw.clone()},
        complementary_data={"task": [TASK]},
    )
    for step in preprocessor.steps:
        if isinstance(step, (NormalizerProcessorStep, Pi05PrepareStateTokenizerProcessorStep)):
            transition = step(transition)
    state_norm = transition[TransitionKey.OBSERVATION]["observation.state"]
    prompt = transition[TransitionKey.COMPLEMENTARY_DATA]["task"][0]

    actions_unnorm = postprocessor(actions[:, :, :ACTION_DIM].clone())
    return {
        "task": TASK,
        "state_raw": state_raw[0].tolist(),
        "state_normalized": state_norm[0].tolist(),
        "prompt": prompt,
        "steps": {
            "preprocessor": [type(s).__name__ for s in preprocessor.steps],
            "postprocessor": [type(s).__name__ for s in postprocessor.steps],
        },
        "_actions_unnormalized": actions_unnorm,  # tensor, saved to io.safetensors
    }


def preprocessor_stats(preprocessor) -> dict[str, torch.Tensor]:
    from lerobot.processor import NormalizerProcessorStep

    for step in preprocessor.steps:
        if isinstance(step, NormalizerProcessorStep):
            return step.state_dict()
    raise RuntimeError("no NormalizerProcessorStep in preprocessor")


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------
def make_inputs(policy, cameras: int, seed: int, prompt_len: int = PROMPT_LEN) -> dict[str, torch.Tensor]:
    """Deterministic inputs. Raw images are in [0, 1]; the model sees them in [-1, 1].

    The [0, 1] -> [-1, 1] map (and resize_with_pad when the size differs) is done by
    PI05Policy._preprocess_images, not by sample_actions, so we call that method here to get
    exactly what the policy would feed the model. Only the ``cameras`` real cameras get an
    image; LeRobot itself fills each empty camera with a -1 image and a False mask, and every
    slot it feeds the model is saved (pixel_values_i / image_mask_i for i < real + empty).
    """
    gen = torch.Generator().manual_seed(seed + 1)
    raw = [torch.rand(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen) for _ in range(cameras)]
    vocab = policy.model.paligemma_with_expert.paligemma.config.text_config.vocab_size
    tokens = torch.zeros(1, TOKEN_LEN, dtype=torch.int64)
    tokens[0, 0] = 2  # <bos>, as the Gemma tokenizer would add
    # Ordinary text ids, below the 256000+ range of <locNNNN>/<segNNN> special tokens.
    tokens[0, 1:prompt_len] = torch.randint(3, min(256000, vocab), (prompt_len - 1,), generator=gen)
    token_mask = torch.zeros(1, TOKEN_LEN, dtype=torch.bool)
    token_mask[0, :prompt_len] = True
    noise = torch.randn(1, policy.config.chunk_size, policy.config.max_action_dim, generator=gen)

    batch = {key: img for key, img in zip(policy.config.image_features, raw, strict=False)}
    pixel_values, img_masks = policy._preprocess_images(batch)
    out = {"tokens": tokens, "token_mask": token_mask, "noise": noise}
    for i in range(cameras):
        out[f"image_{i}"] = raw[i].contiguous()
    for i in range(len(pixel_values)):
        out[f"pixel_values_{i}"] = pixel_values[i].contiguous()
        out[f"image_mask_{i}"] = img_masks[i].contiguous()
    return out


# --------------------------------------------------------------------------------------
# Phase timers
# --------------------------------------------------------------------------------------
class PhaseTimer:
    """Accumulates wall time of wrapped callables per phase for one sample_actions call.

    Wrapping is done on instance attributes, which the call sites look up at run time:
      vision : PaliGemmaWithExpertModel.embed_image (SigLIP + multi_modal_projector, per camera)
      prefill: paligemma.model.language_model.forward (the VLM pass over the prefix that
               returns the KV cache; PaliGemmaWithExpertModel.forward calls it by attribute)
      denoise: PI05Pytorch.denoise_step (called num_inference_steps times by euler_integrate;
               includes the per-step KV-cache clone, suffix embedding and action_out_proj)
    `other` = total - (vision + prefill + denoise): token embedding, mask building, Euler adds.
    """

    def __init__(self):
        self.acc = {"vision": 0.0, "prefill": 0.0, "denoise": 0.0}
        self.calls = {k: 0 for k in self.acc}

    def reset(self):
        for k in self.acc:
            self.acc[k] = 0.0
            self.calls[k] = 0

    def wrap(self, obj, attr: str, phase: str):
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[phase] += time.perf_counter() - t0
                self.calls[phase] += 1

        setattr(obj, attr, timed)


@torch.no_grad()
def capture_intermediates(policy, images, img_masks, tokens, token_mask, noise) -> dict[str, torch.Tensor]:
    """One extra (untimed) sample_actions call that records per-phase intermediates.

    Random weights give diffuse attention, so the final actions are only weakly sensitive to
    the prefix (see `sensitivity` in lerobot_timing.json); these tensors let a port be checked
    phase by phase instead:
      prefix_embs    [1, P, 2048]  output of PI05Pytorch.embed_prefix (image tokens cam0..camN-1,
                                   then language tokens), P = 256 * cameras + 200
      prefix_pad_mask[1, P] bool
      kv_k_{l}, kv_v_{l} [1, 1, P, 256]  VLM KV cache after the prefill (keys after RoPE)
      adarms_cond    [S, 1, 1024]  time conditioning per Euler step (embed_suffix output)
      x_t            [S, 1, 50, 32] denoise_step input per step; v_t: its output (velocity)
    """
    model = policy.model
    lm = model.paligemma_with_expert.paligemma.model.language_model
    caps: dict[str, object] = {"adarms_cond": [], "x_t": [], "v_t": []}
    saved = {}

    def wrap(obj, attr, post):
        fn = getattr(obj, attr)
        saved[(id(obj), attr)] = (obj, attr, obj.__dict__.get(attr))

        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            post(out, args, kwargs)
            return out

        setattr(obj, attr, wrapped)

    def on_prefix(out, args, kwargs):
        caps["prefix_embs"], caps["prefix_pad_mask"] = out[0].clone(), out[1].clone()

    def on_lm(out, args, kwargs):
        if kwargs.get("use_cache"):
            for layer, (k, v, _) in enumerate(out.past_key_values):
                caps[f"kv_k_{layer}"], caps[f"kv_v_{layer}"] = k.clone(), v.clone()

    def on_suffix(out, args, kwargs):
        caps["adarms_cond"].append(out[3].clone())

    def on_denoise(out, args, kwargs):
        caps["x_t"].append(kwargs["x_t"].clone())
        caps["v_t"].append(out.clone())

    wrap(model, "embed_prefix", on_prefix)
    wrap(lm, "forward", on_lm)
    wrap(model, "embed_suffix", on_suffix)
    wrap(model, "denoise_step", on_denoise)
    try:
        caps["actions"] = model.sample_actions(images, img_masks, tokens, token_mask, noise=noise.clone())
    finally:
        for obj, attr, prev in saved.values():  # restore the previous instance attributes
            if prev is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, prev)
    for k in ("adarms_cond", "x_t", "v_t"):
        caps[k] = torch.stack(caps[k])
    return caps


@torch.no_grad()
def verify_checkpoint(args) -> int:
    """Reload DIR/ckpt with PI05Policy.from_pretrained and check it reproduces DIR/io.safetensors.

    Run as a separate process (`--verify-ckpt`) so that only one model is in memory. The
    depth patches are still needed: config.json does not record layer counts.
    """
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from safetensors.torch import load_file

    torch.set_num_threads(args.threads)
    patch_depths(args.vlm_layers, args.expert_layers, args.vision_layers)
    io = load_file(str(args.out / "io.safetensors"))
    t0 = time.perf_counter()
    policy = PI05Policy.from_pretrained(str(args.out / "ckpt"), local_files_only=True)
    policy.eval()
    log(f"loaded checkpoint in {time.perf_counter() - t0:.1f}s")
    n = sum(1 for k in io if k.startswith("pixel_values_"))
    images = [io[f"pixel_values_{i}"] for i in range(n)]
    masks = [io[f"image_mask_{i}"] for i in range(n)]
    a = policy.model.sample_actions(images, masks, io["tokens"], io["token_mask"], noise=io["noise"].clone())
    diff = (a - io["actions"]).abs().max().item()
    log(f"reloaded checkpoint vs io.safetensors actions: max abs diff {diff:.3e}")
    return 0 if diff == 0.0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vlm-layers", type=int, default=18)
    ap.add_argument("--expert-layers", type=int, default=18)
    ap.add_argument("--vision-layers", type=int, default=27)
    ap.add_argument("--cameras", type=int, default=3, choices=(1, 2, 3), help="real cameras (images given)")
    ap.add_argument("--empty-cameras", type=int, default=0, help="PI05Config.empty_cameras (blank, masked slots)")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help=f"valid prompt tokens (<= {TOKEN_LEN})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-save-ckpt", action="store_true", help="skip writing DIR/ckpt (several GB)")
    ap.add_argument("--verify-ckpt", action="store_true",
                    help="only reload DIR/ckpt and check it reproduces DIR/io.safetensors")
    args = ap.parse_args()
    if not 1 <= args.prompt_len <= TOKEN_LEN:
        ap.error(f"--prompt-len must be in [1, {TOKEN_LEN}], got {args.prompt_len}")
    if args.verify_ckpt:
        return verify_checkpoint(args)

    import lerobot
    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    log(f"torch {torch.__version__}, lerobot {lerobot.__version__}, threads {torch.get_num_threads()}, "
        f"loadavg {load_before}")

    # ---- build -------------------------------------------------------------------------
    patch_depths(args.vlm_layers, args.expert_layers, args.vision_layers)
    t0 = time.perf_counter()
    policy = build_policy(args)
    log(f"built PI05Policy in {time.perf_counter() - t0:.1f}s, peak RSS {peak_rss_mb():.0f} MB")
    pwe = policy.model.paligemma_with_expert
    n_vlm = len(pwe.paligemma.model.language_model.layers)
    n_exp = len(pwe.gemma_expert.model.layers)
    n_vis = len(pwe.paligemma.model.vision_tower.vision_model.encoder.layers)
    assert (n_vlm, n_exp, n_vis) == (args.vlm_layers, args.expert_layers, args.vision_layers), (
        n_vlm, n_exp, n_vis)
    n_params = sum(p.numel() for p in policy.parameters())
    log(f"layers: vlm {n_vlm}, expert {n_exp}, siglip {n_vis}; {n_params / 1e9:.3f} B parameters")

    n_pert = perturb_parameters(policy, seed=args.seed + 100, std=PERTURB_STD)
    log(f"perturbed {n_pert} floating parameters by {PERTURB_STD} * N(0,1)")
    pali = pwe.paligemma
    tie_gap = (pali.lm_head.weight - pali.model.language_model.embed_tokens.weight).abs().max().item()
    log(f"embed_tokens vs lm_head after perturbation: max abs diff {tie_gap:.3e} (saved as they are)")

    # ---- checkpoint + processors ---------------------------------------------------------
    stats = make_dataset_stats(args.seed)
    preprocessor, postprocessor = make_processors(policy.config, stats)
    ckpt = out / "ckpt"
    if not args.no_save_ckpt:
        t0 = time.perf_counter()
        policy.save_pretrained(ckpt)
        preprocessor.save_pretrained(ckpt)
        postprocessor.save_pretrained(ckpt)
        describe_ckpt(ckpt, out / "ckpt_files.txt")
        log(f"saved checkpoint + processors to {ckpt} in {time.perf_counter() - t0:.1f}s")

    # ---- inputs ------------------------------------------------------------------------
    inputs = make_inputs(policy, args.cameras, args.seed, args.prompt_len)
    slots = sum(1 for k in inputs if k.startswith("pixel_values_"))
    assert slots == args.cameras + args.empty_cameras, (slots, args.cameras, args.empty_cameras)
    images = [inputs[f"pixel_values_{i}"] for i in range(slots)]
    img_masks = [inputs[f"image_mask_{i}"] for i in range(slots)]
    tokens, token_mask, noise = inputs["tokens"], inputs["token_mask"], inputs["noise"]

    # ---- timed runs ----------------------------------------------------------------------
    timer = PhaseTimer()
    timer.wrap(pwe, "embed_image", "vision")
    timer.wrap(pwe.paligemma.model.language_model, "forward", "prefill")
    timer.wrap(policy.model, "denoise_step", "denoise")

    all_s = {"total": [], "vision": [], "prefill": [], "denoise": [], "other": []}
    actions = None
    with torch.no_grad():
        for r in range(args.repeats):
            timer.reset()
            t0 = time.perf_counter()
            a = policy.model.sample_actions(images, img_masks, tokens, token_mask, noise=noise.clone())
            total = time.perf_counter() - t0
            all_s["total"].append(total)
            for k in ("vision", "prefill", "denoise"):
                all_s[k].append(timer.acc[k])
            all_s["other"].append(total - sum(timer.acc.values()))
            log(f"run {r}: total {total:.3f}s  vision {timer.acc['vision']:.3f}s "
                f"prefill {timer.acc['prefill']:.3f}s  denoise {timer.acc['denoise']:.3f}s "
                f"(calls {timer.calls})  rss {peak_rss_mb():.0f} MB")
            if actions is None:
                actions = a.clone()
            elif not torch.equal(a, actions):
                log(f"WARNING: run {r} differs from run 0 by max {(a - actions).abs().max().item():.3e}")
    load_after = os.getloadavg()
    # sample_actions itself switches the VLM and expert to "eager"; SigLIP keeps its default.
    attn_impl = {
        "vision": pwe.paligemma.model.vision_tower.config._attn_implementation,
        "vlm": pwe.paligemma.model.language_model.config._attn_implementation,
        "expert": pwe.gemma_expert.model.config._attn_implementation,
    }

    # ---- sanity: actions must be non-degenerate and depend on the prefix -----------------
    assert actions.shape == (1, policy.config.chunk_size, policy.config.max_action_dim), actions.shape
    assert torch.isfinite(actions).all(), "non-finite actions"
    per_dim_std = actions[0].std(dim=0)
    spread_across_dims = actions[0].mean(dim=0).std().item()
    log(f"actions: mean {actions.mean():.4f} std {actions.std():.4f} absmax {actions.abs().max():.4f}; "
        f"std over time per dim min {per_dim_std.min():.4f}; spread of dim means {spread_across_dims:.4f}")
    assert actions.abs().max() > 1e-3 and actions.std() > 1e-3, "degenerate (near-zero) actions"
    assert spread_across_dims > 1e-3, "actions do not vary across action dims"
    with torch.no_grad():
        alt_images = [images[0].flip(-1)] + images[1:]
        a_img = policy.model.sample_actions(alt_images, img_masks, tokens, token_mask, noise=noise.clone())
        alt_tokens = tokens.clone()
        alt_tokens[0, 1:args.prompt_len] = alt_tokens[0, 1:args.prompt_len].roll(1)
        a_tok = policy.model.sample_actions(images, img_masks, alt_tokens, token_mask, noise=noise.clone())
    rel = lambda b: ((b - actions).norm() / actions.norm()).item()  # noqa: E731
    sensitivity = {"flip_image_0": rel(a_img), "roll_prompt_tokens": rel(a_tok)}
    log(f"sensitivity (relative change of actions): {sensitivity}")
    caps = capture_intermediates(policy, images, img_masks, tokens, token_mask, noise)
    assert torch.equal(caps.pop("actions"), actions), "capture run differs from the timed runs"
    log("captured intermediates: " + ", ".join(f"{k}{list(v.shape)}" for k, v in caps.items()))

    # ---- outputs -----------------------------------------------------------------------
    proc = processor_reference(preprocessor, postprocessor, actions, args.seed)
    actions_unnorm = proc.pop("_actions_unnormalized")
    io = {k: v.contiguous() for k, v in inputs.items()}
    io["actions"] = actions.contiguous()
    io["actions_unnormalized"] = actions_unnorm.contiguous()
    io["state_raw"] = torch.tensor(proc["state_raw"], dtype=torch.float32)
    io["state_normalized"] = torch.tensor(proc["state_normalized"], dtype=torch.float32)
    io["image_mask"] = torch.stack(img_masks, dim=1)  # [1, cameras] bool
    io.update({k: v.contiguous() for k, v in caps.items()})
    save_file(io, str(out / "io.safetensors"), metadata={
        "note": "image_i: raw [0,1] policy input; pixel_values_i: [-1,1] tensor passed to sample_actions; "
                "actions: raw sample_actions output [1,50,32]; actions_unnormalized: postprocessor(actions); "
                "prefix_embs, kv_*, adarms_cond, x_t, v_t: intermediates (see capture_intermediates)",
        "camera_keys": json.dumps(list(policy.config.image_features)),
    })
    (out / "processor_io.json").write_text(json.dumps(proc, indent=2) + "\n")

    med = {k: statistics.median(v) for k, v in all_s.items()}
    timing = {
        "config": {
            "vlm_layers": n_vlm, "expert_layers": n_exp, "vision_layers": n_vis,
            "cameras": args.cameras, "empty_cameras": args.empty_cameras,
            "threads": torch.get_num_threads(), "seed": args.seed,
            "repeats": args.repeats, "dtype": "float32", "num_inference_steps": policy.config.num_inference_steps,
            "prefix_len": slots * 256 + TOKEN_LEN, "valid_prompt_tokens": args.prompt_len,
            "embed_tokens_vs_lm_head_max_abs_diff": tie_gap,
            "n_parameters": n_params, "attn_implementation": attn_impl,
            "torch": torch.__version__, "lerobot": lerobot.__version__,
            "transformers": __import__("transformers").__version__, "python": sys.version.split()[0],
        },
        "median_s": med,
        "all_s": all_s,
        "loadavg": {"before": list(load_before), "after": list(load_after)},
        "peak_rss_mb": peak_rss_mb(),
        "actions_stats": {"mean": actions.mean().item(), "std": actions.std().item(),
                          "absmax": actions.abs().max().item()},
        "sensitivity": sensitivity,
    }
    (out / "lerobot_timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    log(f"median: total {med['total']:.3f}s vision {med['vision']:.3f}s prefill {med['prefill']:.3f}s "
        f"denoise {med['denoise']:.3f}s other {med['other']:.3f}s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
