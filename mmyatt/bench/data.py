"""`mmyatt bench data-sharding`: memory per process, P parallel controllers vs one driver.

One image+video manifest (generated into a temp dir; about 1.2 GB once decoded) is read
two ways, each process a separate interpreter that imports torch as a trainer does:

* **parallel controllers** (ours), P = 1, 2, 4: every controller is its own process and
  reads and decodes only its own records with :class:`ShardedManifest` and
  :func:`media_transform` (the decode path of a run), and keeps them;
* **single driver** (the single-controller pattern), P = 4 workers: one process reads
  and decodes *every* record with the same manifest reader and decode path, keeps the
  decoded set (as a driver holds a batch before dispatch), then sends each worker its
  share over a pipe (pickled, one record per message); the workers keep what they get.

Every process measures itself at the end: peak RSS from ``/proc/self/status`` VmHWM
(the high-water mark of this process's own address space; ``ru_maxrss`` is recorded
too, but a spawned child's ``ru_maxrss`` can include its parent's pages from before
``exec``) and the decoded bytes it holds (pixels x 3 for RGB images, ``nbytes`` of video
frame arrays). All ratios are computed from those measurements. ``idle`` is a process
that imports the same modules and holds nothing: the interpreter's share of every
figure. A driver's worker and a controller of the same rank hold the same records
(checked by record index).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import resource
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

import mmyatt.datasets.manifest  # noqa: F401
import mmyatt.datasets.media  # noqa: F401
from mmyatt.datasets.manifest import ShardedManifest
from mmyatt.datasets.media import media_transform, write_video

FPS, MAX_FRAMES = 8.0, 16  # every frame of a 16-frame clip at 8 fps is kept


def _peak() -> dict:
    """This process's peak RSS: VmHWM (own address space) and ru_maxrss, in MB."""
    hwm = None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_rss_mb": round(hwm if hwm is not None else maxrss, 1), "ru_maxrss_mb": maxrss}


def _bytes_held(records: list[dict]) -> int:
    total = 0
    for rec in records:
        img = rec.get("image")
        for im in img if isinstance(img, list) else ([img] if img is not None else []):
            total += im.width * im.height * len(im.getbands())
        vid = rec.get("video")
        if isinstance(vid, np.ndarray):
            total += vid.nbytes
    return total


def _reader(manifest: str, rank: int, world: int):

    return ShardedManifest(
        [manifest],
        rank=rank,
        world_size=world,
        shuffle=False,
        transform=partial(media_transform, fps=FPS, max_frames=MAX_FRAMES),
    )


def _imports() -> None:
    """What every process of both patterns loads: torch, the manifest and media code."""
    import torch

    torch.set_num_threads(1)


def _idle(out: str) -> None:
    _imports()
    Path(out).write_text(json.dumps({"role": "idle", **_peak()}))


def _controller(manifest: str, rank: int, world: int, out: str) -> None:
    _imports()
    t0 = time.perf_counter()
    m = _reader(manifest, rank, world)
    held = m.eval_records()  # records rank, rank + P, ...: this controller's shard, kept
    info = {
        "role": "controller",
        "rank": rank,
        "records": len(held),
        "parsed": m.num_parsed,
        "indices": [r["_index"] for r in held],
        "bytes_held": _bytes_held(held),
        "ready_s": round(time.perf_counter() - t0, 3),
        **_peak(),
    }
    Path(out).write_text(json.dumps(info))


def _worker(conn, rank: int, out: str) -> None:
    _imports()
    held, received = [], 0
    while True:
        msg = conn.recv_bytes()
        if msg == b"":
            break
        received += len(msg)
        held.append(pickle.loads(msg))
    conn.close()
    info = {
        "role": "worker",
        "rank": rank,
        "records": len(held),
        "indices": [r["_index"] for r in held],
        "bytes_held": _bytes_held(held),
        "bytes_received": received,
        **_peak(),
    }
    Path(out).write_text(json.dumps(info))


def _driver(manifest: str, conns: list, out: str) -> None:
    _imports()
    t0 = time.perf_counter()
    m = _reader(manifest, 0, 1)
    everything = m.eval_records()  # read and decode every record, keep the decoded set
    decoded_s = time.perf_counter() - t0
    held = _bytes_held(everything)
    sent = [0] * len(conns)
    for rec in everything:  # record i goes where controller i % P reads it
        w = rec["_index"] % len(conns)
        msg = pickle.dumps(rec, protocol=pickle.HIGHEST_PROTOCOL)
        conns[w].send_bytes(msg)
        sent[w] += len(msg)
    for c in conns:
        c.send_bytes(b"")
        c.close()
    info = {
        "role": "driver",
        "records": len(everything),
        "parsed": m.num_parsed,
        "bytes_held": held,
        "bytes_sent": sent,
        "decode_s": round(decoded_s, 3),
        "ready_s": round(time.perf_counter() - t0, 3),
        **_peak(),
    }
    Path(out).write_text(json.dumps(info))


def _write_manifest(
    root: Path, n_images: int, image_size: int, n_videos: int, video_size: int
) -> Path:
    """Smooth coloured images with a disc, and 16-frame clips of a moving gradient:
    compressible on disk, full-size once decoded."""
    from PIL import Image, ImageDraw

    (root / "media").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    recs = []
    y, x = np.mgrid[0:image_size, 0:image_size]
    for i in range(n_images):
        a, b, c = rng.integers(0, 256, 3)
        arr = np.stack([(x + a) % 256, (y + b) % 256, ((x + y) // 2 + c) % 256], -1)
        im = Image.fromarray(arr.astype(np.uint8))
        r = image_size // 4
        cx, cy = rng.integers(r, image_size - r, 2)
        ImageDraw.Draw(im).ellipse([cx - r, cy - r, cx + r, cy + r], fill=(200, 30, 30))
        path = root / "media" / f"img{i}.png"
        im.save(path)
        recs.append({"prompt": "What colour is the disc?", "image": str(path), "answer": "red"})
    vy, vx = np.mgrid[0:video_size, 0:video_size]
    for i in range(n_videos):
        base = np.stack([vx % 256, vy % 256, np.full_like(vx, (i * 37) % 256)], -1)
        frames = [np.roll(base, 8 * k, axis=1).astype(np.uint8) for k in range(16)]
        path = write_video(frames, root / "media" / f"vid{i}.mp4", fps=8)
        recs.append({"prompt": "Which way does it move?", "video": str(path), "answer": "right"})
    order = rng.permutation(len(recs))
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(recs[i]) + "\n" for i in order))
    return manifest


def _run(procs: list) -> None:
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"data-sharding process failed with exit code {p.exitcode}")


def bench_data_sharding(quick: bool = False) -> dict:
    if quick:
        n_images, image_size, n_videos, video_size = 24, 64, 4, 32
    else:
        n_images, image_size, n_videos, video_size = 1024, 448, 192, 256
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    out: dict = {
        "benchmark": "data-sharding",
        "images": n_images,
        "image_size": image_size,
        "videos": n_videos,
        "video": f"16 frames {video_size}x{video_size} at 8 fps, all 16 decoded",
        "rss": "VmHWM of each process (/proc/self/status), MB",
        "bytes_held": "decoded pixels held by the process: RGB images x 3 B/px, video arrays",
    }
    with tempfile.TemporaryDirectory(prefix="mmyatt-data-bench-") as d:
        root = Path(d)
        manifest = str(_write_manifest(root, n_images, image_size, n_videos, video_size))
        out["generate_s"] = round(time.perf_counter() - t0, 1)
        n = n_images + n_videos

        idle = root / "idle.json"
        _run([ctx.Process(target=_idle, args=(str(idle),))])
        out["idle"] = json.loads(idle.read_text())

        shares: dict[int, list[list[int]]] = {}
        for world in (1, 4) if quick else (1, 2, 4):
            files = [root / f"p{world}_r{r}.json" for r in range(world)]
            t1 = time.perf_counter()
            _run(
                [
                    ctx.Process(target=_controller, args=(manifest, r, world, str(files[r])))
                    for r in range(world)
                ]
            )
            ranks = [json.loads(f.read_text()) for f in files]
            shares[world] = [r.pop("indices") for r in ranks]
            assert sum(r["records"] for r in ranks) == n
            assert all(r["parsed"] == r["records"] for r in ranks)  # read isolation
            out[f"controllers_p{world}"] = {"wall_s": round(time.perf_counter() - t1, 2)}
            out[f"controllers_p{world}"]["ranks"] = ranks
            out[f"controller_peak_rss_mb_p{world}"] = max(r["peak_rss_mb"] for r in ranks)
            out[f"controller_bytes_held_p{world}"] = max(r["bytes_held"] for r in ranks)

        world = 4
        files = [root / f"worker{r}.json" for r in range(world)]
        pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
        workers = [
            ctx.Process(target=_worker, args=(pipes[r][0], r, str(files[r]))) for r in range(world)
        ]
        drv_file = root / "driver.json"
        driver = ctx.Process(target=_driver, args=(manifest, [w for _, w in pipes], str(drv_file)))
        t1 = time.perf_counter()
        _run([*workers, driver])
        for recv, send in pipes:
            recv.close()
            send.close()
        drv = json.loads(drv_file.read_text())
        wks = [json.loads(f.read_text()) for f in files]
        # the driver's workers hold exactly what the controllers of the same rank read
        assert [w.pop("indices") for w in wks] == shares[world]
        assert drv["records"] == n and sum(w["records"] for w in wks) == n
        out["driver_p4"] = {
            "wall_s": round(time.perf_counter() - t1, 2),
            "driver": drv,
            "workers": wks,
        }
    base = out["idle"]["peak_rss_mb"]
    ctl_rss, ctl_bytes = out["controller_peak_rss_mb_p4"], out["controller_bytes_held_p4"]
    out["driver_peak_rss_mb"] = drv["peak_rss_mb"]
    out["driver_bytes_held"] = drv["bytes_held"]
    out["driver_bytes_sent"] = sum(drv["bytes_sent"])
    out["worker_peak_rss_mb_p4"] = max(w["peak_rss_mb"] for w in wks)
    out["decoded_bytes_total"] = sum(r["bytes_held"] for r in out["controllers_p4"]["ranks"])
    out["driver_over_controller_rss_p4"] = round(drv["peak_rss_mb"] / ctl_rss, 3)
    out["driver_over_controller_bytes_p4"] = round(drv["bytes_held"] / ctl_bytes, 3)
    out["driver_over_controller_rss_above_idle_p4"] = round(
        (drv["peak_rss_mb"] - base) / (ctl_rss - base), 3
    )
    for world in (4,) if quick else (2, 4):
        out[f"controller_rss_ratio_p{world}_over_p1"] = round(
            out[f"controller_peak_rss_mb_p{world}"] / out["controller_peak_rss_mb_p1"], 3
        )
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out
