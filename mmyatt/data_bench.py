"""`mmyatt bench data-sharding`: decoded media per controller, ours vs a driver.

One image+video manifest is read by P = 1, 2 and 4 controllers, each a separate
process that reads, decodes and holds only its own records (as a controller keeps its
shard of a step's media). The baseline is the driver pattern of single-controller
frameworks: one process loads and decodes every record, then scatters it to workers
(the driver holds everything it scatters). Reported per process: decoded-media bytes
held and peak RSS.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import resource
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np


def _media_bytes(rec: dict) -> int:
    total = 0
    img = rec.get("image")
    for im in img if isinstance(img, list) else ([img] if img is not None else []):
        total += len(im.tobytes())
    vid = rec.get("video")
    if isinstance(vid, np.ndarray):
        total += vid.nbytes
    return total


def _controller(manifest: str, rank: int, world: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from mmyatt.datasets.manifest import ShardedManifest
    from mmyatt.datasets.media import media_transform

    m = ShardedManifest(
        [manifest],
        rank=rank,
        world_size=world,
        shuffle=False,
        transform=partial(media_transform, fps=2.0, max_frames=8),
    )
    held = m.eval_records()  # this controller's whole shard, decoded and kept
    info = {
        "rank": rank,
        "records": len(held),
        "parsed": m.num_parsed,
        "media_bytes": sum(_media_bytes(r) for r in held),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    Path(out).write_text(json.dumps(info))


def _driver(manifest: str, world: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from mmyatt.datasets.manifest import ShardedManifest
    from mmyatt.datasets.media import media_transform

    m = ShardedManifest(
        [manifest], shuffle=False, transform=partial(media_transform, fps=2.0, max_frames=8)
    )
    everything = m.eval_records()
    # scatter: per-worker lists (references; a real driver also serialises them)
    shards = [everything[r::world] for r in range(world)]
    info = {
        "records": sum(len(s) for s in shards),
        "media_bytes": sum(_media_bytes(r) for r in everything),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    Path(out).write_text(json.dumps(info))


def _write_manifest(root: Path, n_images: int, n_videos: int) -> Path:
    from mmyatt.datasets.media import write_video
    from mmyatt.datasets.shapes import COLOURS, SHAPES, draw_shape, moving_shape_clip

    rng = np.random.default_rng(0)
    (root / "media").mkdir(parents=True, exist_ok=True)
    recs = []
    for i in range(n_images):
        c, s = list(COLOURS)[i % len(COLOURS)], SHAPES[i % len(SHAPES)]
        path = root / "media" / f"img{i}.png"
        draw_shape(c, s, size=224, rng=rng).save(path)
        recs.append({"prompt": f"What colour is the {s}?", "image": str(path), "answer": c})
    for i in range(n_videos):
        frames = moving_shape_clip("red", "square", "right", num_frames=16, size=112, rng=rng)
        path = write_video([np.asarray(f) for f in frames], root / "media" / f"vid{i}.mp4", fps=8)
        recs.append({"prompt": "Which way does it move?", "video": str(path), "answer": "right"})
    order = rng.permutation(len(recs))
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(recs[i]) + "\n" for i in order))
    return manifest


def _run(target, args) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"data-sharding worker failed with exit code {p.exitcode}")


def bench_data_sharding(quick: bool = False) -> dict:
    n_images, n_videos = (32, 8) if quick else (768, 128)
    t0 = time.perf_counter()
    out: dict = {
        "benchmark": "data-sharding",
        "images": n_images,
        "videos": n_videos,
        "image_size": 224,
        "video": "16 frames 112x112 at 8 fps, read at 2 fps",
    }
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        manifest = str(_write_manifest(root, n_images, n_videos))
        for world in (1, 2, 4):
            files = [str(root / f"p{world}_r{r}.json") for r in range(world)]
            _run(_controller, [(manifest, r, world, files[r]) for r in range(world)])
            ranks = [json.loads(Path(f).read_text()) for f in files]
            out[f"p{world}"] = ranks
            out[f"media_bytes_per_controller_p{world}"] = max(r["media_bytes"] for r in ranks)
            out[f"peak_rss_mb_per_controller_p{world}"] = max(r["peak_rss_mb"] for r in ranks)
            assert sum(r["records"] for r in ranks) == n_images + n_videos
            assert all(r["parsed"] == r["records"] for r in ranks)  # read isolation
        driver_file = str(root / "driver.json")
        _run(_driver, [(manifest, 4, driver_file)])
        drv = json.loads(Path(driver_file).read_text())
        out["driver"] = drv
    p1, p4 = out["media_bytes_per_controller_p1"], out["media_bytes_per_controller_p4"]
    out["media_bytes_ratio_p4_over_p1"] = p4 / p1
    out["media_bytes_ratio_p2_over_p1"] = out["media_bytes_per_controller_p2"] / p1
    out["driver_over_controller_p4"] = drv["media_bytes"] / p4
    out["driver_rss_over_controller_rss_p4"] = (
        drv["peak_rss_mb"] / out["peak_rss_mb_per_controller_p4"]
    )
    out["wall_s"] = time.perf_counter() - t0
    return out
