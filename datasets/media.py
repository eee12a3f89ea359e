"""Image and video decoding for manifest records.

Images decode with Pillow; videos with decord when it is installed (the optional
``video`` extra) and PyAV otherwise. A video is sampled uniformly at a target fps, the
way Qwen2-VL's reference pipeline does it::

    n = clamp(round(duration_s * fps), 2, max_frames), rounded down to an even count
    idx = round(linspace(0, num_frames - 1, n))

(even, because Qwen2-VL's temporal patch holds 2 frames). Decoded videos are uint8
arrays ``(T, H, W, 3)``; images are RGB ``PIL.Image``.

Relative media paths in a record resolve against the directory of the manifest the
record came from (its ``_source``, ``"path/to/manifest.jsonl:LINE"``), so a task folder
can be moved or copied as a whole; without a source they resolve against the cwd.

A missing or undecodable file raises :class:`MediaError` (a ``ValueError``) whose
message names the file and the record. ``MEDIA_STATS`` counts what this process
decoded: ``bytes`` is the size of the decoded pixel arrays handed out (H*W*3 per image
or sampled frame), the quantity a controller holds in memory for its own shard.

``media_transform`` is the hook for :class:`mmyatt.datasets.ShardedManifest`'s
``transform``: the manifest calls it only for records this rank owns, so each rank
decodes only its own media.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

MEDIA_STATS: dict[str, int] = {"bytes": 0, "images": 0, "videos": 0, "frames": 0}

VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".gif")


class MediaError(ValueError):
    """A media file is missing or cannot be decoded; the message names file and record."""


def reset_media_stats() -> None:
    for key in MEDIA_STATS:
        MEDIA_STATS[key] = 0


# --- paths ---------------------------------------------------------------------------
def _manifest_dir(source: str | None) -> Path | None:
    """Directory of the manifest named by a ``"path:line"`` record source, if it exists."""
    if not source:
        return None
    path = source.rsplit(":", 1)[0] if ":" in source else source
    directory = Path(path).parent
    return directory if Path(path).is_file() else None


def resolve_media_path(path: str | os.PathLike, source: str | None = None) -> Path:
    """``path`` as given when absolute, else relative to the record's manifest directory
    (when ``source`` names an existing manifest), else relative to the cwd."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    root = _manifest_dir(source)
    return root / p if root is not None else p


def _where(source: str | None) -> str:
    """Where a record came from, as errors start: ``file:line``."""
    return source if source else "a record of unknown origin"


# --- images --------------------------------------------------------------------------
def _decode_data_url(url: str, source: str | None) -> Image.Image:
    head, _, payload = url.partition(",")
    if ";base64" not in head:
        raise MediaError(f"{_where(source)}: only base64 data URLs are supported, got {head!r}")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=False)))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise MediaError(f"{_where(source)}: cannot decode data URL image: {error}") from error
    return image


def image_to_data_url(image: Image.Image, fmt: str = "PNG") -> str:
    """``data:image/png;base64,...`` for an image (what an OpenAI chat message carries)."""
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def load_image(path_or_pil: Any, *, source: str | None = None) -> Image.Image:
    """An RGB PIL image from a path, a ``data:`` URL, a ``file://`` URL, a PIL image or
    an (H, W, 3) uint8 array. Files and data URLs count in ``MEDIA_STATS``."""
    x = path_or_pil
    if isinstance(x, Image.Image):
        return x if x.mode == "RGB" else x.convert("RGB")
    if isinstance(x, np.ndarray):
        return Image.fromarray(np.ascontiguousarray(x, dtype=np.uint8)).convert("RGB")
    if not isinstance(x, (str, os.PathLike)):
        raise MediaError(f"{_where(source)}: cannot load an image from {type(x).__name__}")
    text = os.fspath(x)
    if text.startswith("data:"):
        image = _decode_data_url(text, source)
    else:
        if text.startswith("file://"):
            text = text[len("file://") :]
        elif "://" in text:
            raise MediaError(
                f"{_where(source)}: remote image {text!r}: only local files and data URLs"
            )
        path = resolve_media_path(text, source)
        if not path.is_file():
            raise MediaError(f"{_where(source)}: image file not found: {str(path)!r}")
        try:
            with Image.open(path) as opened:
                opened.load()
                image = opened.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
            raise MediaError(
                f"{_where(source)}: cannot decode image file {str(path)!r}: {error}"
            ) from error
    image = image if image.mode == "RGB" else image.convert("RGB")
    MEDIA_STATS["images"] += 1
    MEDIA_STATS["bytes"] += image.width * image.height * 3
    return image


# --- videos --------------------------------------------------------------------------
def sample_indices(
    num_frames: int, native_fps: float, *, fps: float, max_frames: int
) -> np.ndarray:
    """Uniform frame indices at ``fps``: an even count in [2, max_frames] (see module doc).

    >>> sample_indices(30, 30.0, fps=2.0, max_frames=8).tolist()   # 1 s clip -> 2 frames
    [0, 29]
    >>> sample_indices(8, 4.0, fps=2.0, max_frames=8).tolist()     # 2 s -> 4 frames
    [0, 2, 5, 7]
    """
    if num_frames < 1:
        raise ValueError("a video needs at least one frame")
    if max_frames < 2:
        raise ValueError(f"max_frames must be >= 2, got {max_frames}")
    if fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    duration = num_frames / native_fps if native_fps and native_fps > 0 else num_frames / fps
    n = int(round(duration * fps))
    n = max(2, min(n, max_frames))
    n -= n % 2
    return np.linspace(0, num_frames - 1, n).round().astype(np.int64)


def _decord_available() -> bool:
    try:
        import decord  # noqa: F401
    except ImportError:
        return False
    return True


def _read_decord(path: Path, fps: float, max_frames: int) -> tuple[np.ndarray, float, int]:
    import decord

    reader = decord.VideoReader(str(path), num_threads=1)
    native = float(reader.get_avg_fps() or 0.0)
    idx = sample_indices(len(reader), native, fps=fps, max_frames=max_frames)
    frames = reader.get_batch(idx.tolist()).asnumpy()
    return frames, native, len(reader)


def _read_pyav(path: Path, fps: float, max_frames: int) -> tuple[np.ndarray, float, int]:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        native = float(stream.average_rate or stream.guessed_rate or 0.0)
        # Headers do not always hold the frame count (gif, some webm): decode every frame
        # then. When they do, keep only the sampled frames as arrays.
        count = int(stream.frames or 0)
        if count > 0:
            wanted = sample_indices(count, native, fps=fps, max_frames=max_frames)
            keep: dict[int, np.ndarray] = {}
            targets = set(wanted.tolist())
            last = None
            for i, frame in enumerate(container.decode(stream)):
                if i in targets:
                    keep[i] = frame.to_ndarray(format="rgb24")
                last = i
                if i >= wanted[-1]:
                    break
            if last is not None and all(int(i) in keep for i in wanted):
                return np.stack([keep[int(i)] for i in wanted]), native, count
            container.seek(0)  # the header's count was wrong: fall back to full decode
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    if not frames:
        raise ValueError("no video frames decoded")
    idx = sample_indices(len(frames), native, fps=fps, max_frames=max_frames)
    return np.stack([frames[int(i)] for i in idx]), native, len(frames)


def load_video(
    path: Any, *, fps: float = 2.0, max_frames: int = 8, source: str | None = None
) -> np.ndarray:
    """Uniformly sampled frames ``(T, H, W, 3)`` uint8 of the video at ``path``.

    ``T`` is even and in [2, max_frames]. A list/array of frames is taken as a clip
    already sampled at ``fps``: only ``max_frames`` can shorten it.
    """
    return load_video_with_fps(path, fps=fps, max_frames=max_frames, source=source)[0]


def load_video_with_fps(
    path: Any, *, fps: float = 2.0, max_frames: int = 8, source: str | None = None
) -> tuple[np.ndarray, float]:
    """``load_video`` plus the rate of the returned frames (frames per second of video
    time; differs from ``fps`` when the frame count was clamped). Qwen2.5-VL spaces its
    temporal positions by it."""
    if isinstance(path, np.ndarray) and path.ndim == 4:
        frames = np.ascontiguousarray(path, dtype=np.uint8)
        idx = sample_indices(len(frames), fps, fps=fps, max_frames=max_frames)
        return frames[idx], _rate(len(idx), len(frames), fps)
    if isinstance(path, (list, tuple)):
        frames = np.stack([np.asarray(load_image(f, source=source)) for f in path])
        idx = sample_indices(len(frames), fps, fps=fps, max_frames=max_frames)
        return frames[idx], _rate(len(idx), len(frames), fps)
    if not isinstance(path, (str, os.PathLike)):
        raise MediaError(f"{_where(source)}: cannot load a video from {type(path).__name__}")
    resolved = resolve_media_path(path, source)
    if not resolved.is_file():
        raise MediaError(f"{_where(source)}: video file not found: {str(resolved)!r}")
    reader = _read_decord if _decord_available() else _read_pyav
    try:
        frames, native, total = reader(resolved, fps, max_frames)
    except MediaError:
        raise
    except Exception as error:  # av.error.*, decord.DECORDError, ValueError, OSError
        raise MediaError(
            f"{_where(source)}: cannot decode video file {str(resolved)!r}: "
            f"{type(error).__name__}: {error}"
        ) from error
    frames = np.ascontiguousarray(frames, dtype=np.uint8)
    MEDIA_STATS["videos"] += 1
    MEDIA_STATS["frames"] += int(frames.shape[0])
    MEDIA_STATS["bytes"] += int(frames.nbytes)
    return frames, _rate(len(frames), total, native or fps)


def _rate(kept: int, total: int, native_fps: float) -> float:
    duration = total / native_fps
    return kept / duration if duration > 0 else float(native_fps)


def write_video(
    frames: Sequence[Any] | np.ndarray, path: str | os.PathLike, fps: float = 4.0
) -> Path:
    """Write (T, H, W, 3) uint8 frames (or PIL images) as an H.264 mp4 with PyAV.

    Falls back to an animated GIF through Pillow (same stem, ``.gif``) when PyAV or an
    H.264 encoder is missing, or when ``path`` ends in ``.gif``. Returns the path written.
    Frame sizes are made even for H.264's 4:2:0 chroma by edge padding.
    """
    arrays = [
        np.asarray(f.convert("RGB") if isinstance(f, Image.Image) else f, dtype=np.uint8)
        for f in frames
    ]
    if not arrays:
        raise ValueError("write_video needs at least one frame")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() != ".gif":
        try:
            return _write_mp4(arrays, out, fps)
        except ImportError:  # no PyAV, or a PyAV build without an H.264 encoder
            out = out.with_suffix(".gif")
    images = [Image.fromarray(a) for a in arrays]
    images[0].save(
        out, save_all=True, append_images=images[1:], duration=int(round(1000 / fps)), loop=0
    )
    return out


def _write_mp4(arrays: list[np.ndarray], out: Path, fps: float) -> Path:
    from fractions import Fraction

    import av

    if "libx264" not in av.codecs_available:
        raise ImportError("PyAV has no libx264 encoder")
    h, w = arrays[0].shape[:2]
    pad_h, pad_w = h % 2, w % 2
    with av.open(str(out), mode="w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = w + pad_w, h + pad_h
        stream.pix_fmt = "yuv420p"
        # Near-lossless: tiny synthetic clips must keep their colours and edges.
        stream.options = {"crf": "10", "preset": "veryfast"}
        for a in arrays:
            if pad_h or pad_w:
                a = np.pad(a, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(a), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out


# --- manifest hook -------------------------------------------------------------------
def media_transform(record: dict, *, fps: float = 2.0, max_frames: int = 8) -> dict:
    """Decode a record's media in place of its paths (a new dict is returned).

    ``image`` (one path or a list) becomes RGB PIL image(s); ``video`` becomes a
    ``(T, H, W, 3)`` uint8 array and ``video_fps`` the rate of those frames; the original
    paths stay in ``image_path`` / ``video_path`` for logs. Use it as
    ``ShardedManifest(..., transform=functools.partial(media_transform, fps=2.0))``.
    """
    source = record.get("_source")
    out = dict(record)
    image = record.get("image")
    if image is not None:
        if isinstance(image, list):
            out["image"] = [load_image(x, source=source) for x in image]
        else:
            out["image"] = load_image(image, source=source)
        if isinstance(image, (str, list)):
            out.setdefault("image_path", image)
    video = record.get("video")
    if video is not None and not isinstance(video, np.ndarray):
        out["video"], out["video_fps"] = load_video_with_fps(
            video, fps=fps, max_frames=max_frames, source=source
        )
        if isinstance(video, str):
            out.setdefault("video_path", video)
    return out


def check_media(record: dict) -> dict:
    """``record`` unchanged once every local file its ``image`` / ``video`` names exists;
    a :class:`MediaError` naming the file and the record otherwise. Nothing is decoded:
    this is the check a launcher runs over a whole manifest before controllers start
    (``ShardedManifest.check_records``); decoding errors surface at first read."""
    source = record.get("_source")
    for key in ("image", "video"):
        value = record.get(key)
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, (str, os.PathLike)):
                continue
            text = os.fspath(item)
            if text.startswith("data:") or ("://" in text and not text.startswith("file://")):
                continue
            path = resolve_media_path(text.removeprefix("file://"), source)
            if not path.is_file():
                raise MediaError(f"{_where(source)}: {key} file not found: {str(path)!r}")
    return record
