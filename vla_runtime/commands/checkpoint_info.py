"""``vla-runtime inspect``: what a checkpoint is, read from its headers, ``config.json`` and statistics.

One description serves people (text) and tools / CI (``--json``): the layout, each tower's depth
and width, the cameras (real and empty), chunk and dimensions, the stored dtypes, the tensor the
text embedding is read from, where the normalisation statistics come from, and (on request,
it reads every byte) the content hash. The checkpoint is validated exactly as the loader does,
so whatever ``inspect`` accepts, ``load_checkpoint`` loads.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ..models.checkpoint import content_hash, embedding_key, read_checkpoint_layout
from ..models.checkpoint_meta import camera_layout, read_meta
from ..models.norm_source import checkpoint_normalizers


def _normalization(path: Path, norm_asset: str | None) -> dict[str, Any]:
    """The statistics' source, or why there is none (weights alone are still a valid checkpoint)."""
    if not path.is_dir():
        return {"kind": None, "problem": "a single weights file has no statistics beside it"}
    try:
        return checkpoint_normalizers(path, norm_asset)[2].as_dict()
    except (ValueError, FileNotFoundError) as e:
        return {"kind": None, "problem": str(e)}


def describe_checkpoint(path: str | Path, compute_hash: bool = False, norm_asset: str | None = None) -> dict[str, Any]:
    """Everything ``inspect`` prints, as a JSON-serialisable dict (raises ``CheckpointError`` when invalid)."""
    path = Path(path)
    files, index, layout, cfg = read_checkpoint_layout(path)
    cams = camera_layout(read_meta(path))
    dtypes = Counter(info.dtype for info in index.values())
    return {
        "path": str(path),
        "layout": layout,
        "files": [str(f) for f in files],
        "tensors": len(index),
        "dtype": next(iter(dtypes)) if len(dtypes) == 1 else dict(sorted(dtypes.items())),
        "depths": {"vision": cfg.vision.depth, "vlm": cfg.vlm.depth, "expert": cfg.expert.depth},
        "widths": {"vision": cfg.vision.width, "vlm": cfg.vlm.width, "expert": cfg.expert.width,
                   "vision_mlp": cfg.vision.mlp_dim, "vlm_mlp": cfg.vlm.mlp_dim, "expert_mlp": cfg.expert.mlp_dim},
        "cameras": {"total": cfg.num_cameras, "real": list(cams.real), "empty": list(cams.empty)},
        "image_size": cfg.vision.image_size,
        "chunk_size": cfg.chunk_size,
        "action_dim": cfg.action_dim,
        "max_state_dim": cfg.max_state_dim,
        "vocab_size": cfg.vocab_size,
        "max_token_len": cfg.max_token_len,
        "num_steps": cfg.num_steps,
        "text_embedding": embedding_key(index),
        "normalization": _normalization(path, norm_asset),
        "content_hash": content_hash(files) if compute_hash else None,
    }


def format_text(info: dict[str, Any]) -> str:
    """The description for people: one fact per line."""
    d, w, c, n = info["depths"], info["widths"], info["cameras"], info["normalization"]
    cams = f"{c['total']} ({len(c['real'])} real: {', '.join(c['real']) or '-'}; {len(c['empty'])} empty)"
    norm = (f"{n['kind']} {n['file']} (state {n['state_mode']}, action {n['action_mode']}"
            + (f", asset {n['asset']}" if n.get("asset") else "") + ")") if n["kind"] else f"none ({n['problem']})"
    lines = [
        f"checkpoint      {info['path']} ({info['layout']} layout, {info['tensors']} tensors, dtype {info['dtype']})",
        f"depths          vision {d['vision']}, VLM {d['vlm']}, expert {d['expert']}",
        f"widths          vision {w['vision']}, VLM {w['vlm']}, expert {w['expert']}",
        f"cameras         {cams}, {info['image_size']}x{info['image_size']}",
        f"chunk / dims    {info['chunk_size']} actions x {info['action_dim']}, state {info['max_state_dim']}, "
        f"{info['max_token_len']} prompt tokens, {info['num_steps']} steps",
        f"text embedding  {info['text_embedding']}",
        f"normalisation   {norm}",
        f"content hash    {info['content_hash'] or '(not computed; --hash)'}",
    ]
    return "\n".join(lines)
