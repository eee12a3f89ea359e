"""Image/video decoding for manifest records: round trips, sampling, errors, sharding."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from PIL import Image

from mmyatt.datasets import ManifestError, ShardedManifest
from mmyatt.datasets.media import (
    MEDIA_STATS,
    MediaError,
    image_to_data_url,
    load_image,
    load_video,
    load_video_with_fps,
    media_transform,
    reset_media_stats,
    sample_indices,
    write_video,
)


def moving_square(n: int, direction: str = "right") -> np.ndarray:
    frames = np.full((n, 56, 56, 3), 240, np.uint8)
    for t in range(n):
        x = 4 + 5 * t if direction == "right" else 40 - 5 * t
        frames[t, 20:32, x : x + 12] = (200, 20, 20)
    return frames


def centroid_x(frame: np.ndarray) -> float:
    red = (frame[..., 0] > 150) & (frame[..., 1] < 100)
    return float(np.nonzero(red)[1].mean())


@pytest.mark.parametrize("direction", ["right", "left"])
def test_pyav_round_trip_keeps_motion(tmp_path, direction):
    path = write_video(moving_square(8, direction), tmp_path / "clip.mp4", fps=4.0)
    assert path.suffix == ".mp4"
    frames, rate = load_video_with_fps(path, fps=2.0, max_frames=8)
    assert frames.shape == (4, 56, 56, 3) and frames.dtype == np.uint8  # 2 s at 2 fps
    assert rate == pytest.approx(2.0)
    xs = [centroid_x(f) for f in frames]
    steps = np.diff(xs)
    assert (steps > 0).all() if direction == "right" else (steps < 0).all()
    # colour survives encoding
    assert abs(int(frames[0, 26, int(xs[0]), 0]) - 200) < 20


def test_uniform_sampling_counts():
    assert sample_indices(30, 30.0, fps=2.0, max_frames=8).tolist() == [0, 29]  # 1 s -> 2
    assert len(sample_indices(300, 30.0, fps=2.0, max_frames=8)) == 8  # 10 s clamps to 8
    assert len(sample_indices(300, 30.0, fps=2.0, max_frames=7)) == 6  # even
    assert sample_indices(1, 30.0, fps=2.0, max_frames=8).tolist() == [0, 0]  # at least 2
    idx = sample_indices(100, 25.0, fps=1.0, max_frames=8)
    assert len(idx) == 4 and idx[0] == 0 and idx[-1] == 99 and (np.diff(idx) > 0).all()


def test_frames_list_and_gif(tmp_path):
    frames = moving_square(5)
    assert load_video(list(frames), fps=2.0, max_frames=8).shape[0] == 4
    gif = write_video(frames, tmp_path / "clip.gif", fps=2.0)
    decoded = load_video(gif, fps=2.0, max_frames=8)
    assert decoded.shape[1:] == (56, 56, 3) and decoded.shape[0] % 2 == 0


def test_missing_and_corrupt_files_name_file_and_source(tmp_path):
    src = "train.jsonl:7"
    with pytest.raises(MediaError, match=r"train\.jsonl:7.*nope\.png"):
        load_image(str(tmp_path / "nope.png"), source=src)
    with pytest.raises(MediaError, match=r"train\.jsonl:7.*nope\.mp4"):
        load_video(str(tmp_path / "nope.mp4"), source=src)
    bad_png = tmp_path / "bad.png"
    bad_png.write_bytes(b"\x89PNG not really")
    with pytest.raises(MediaError, match=r"train\.jsonl:7.*bad\.png"):
        load_image(str(bad_png), source=src)
    bad_mp4 = tmp_path / "bad.mp4"
    bad_mp4.write_bytes(b"\x00\x00\x00\x18ftypmp42 garbage" * 4)
    with pytest.raises(MediaError, match=r"train\.jsonl:7.*bad\.mp4"):
        load_video(str(bad_mp4), source=src)
    assert issubclass(MediaError, ValueError)


def test_image_sources_and_stats():
    reset_media_stats()
    image = Image.new("RGB", (56, 40), (1, 2, 3))
    assert load_image(image) is image and MEDIA_STATS["bytes"] == 0  # nothing decoded
    decoded = load_image(image_to_data_url(image))
    assert decoded.size == (56, 40) and decoded.getpixel((0, 0)) == (1, 2, 3)
    assert MEDIA_STATS["bytes"] == 56 * 40 * 3 and MEDIA_STATS["images"] == 1
    with pytest.raises(MediaError, match="remote"):
        load_image("https://example.com/cat.png")


def _write_manifest(tmp_path, n=6):
    (tmp_path / "media").mkdir()
    lines = []
    for i in range(n):
        Image.new("RGB", (56, 56), (10 * i, 0, 0)).save(tmp_path / "media" / f"{i}.png")
        rec = {"prompt": f"q{i}", "image": f"media/{i}.png", "i": i}
        if i % 2 == 0:
            write_video(moving_square(4), tmp_path / "media" / f"{i}.mp4", fps=2.0)
            rec["video"] = f"media/{i}.mp4"
        lines.append(json.dumps(rec))
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "data.jsonl"


def test_media_transform_decodes_only_own_records(tmp_path):
    manifest = _write_manifest(tmp_path)
    reset_media_stats()
    transform = functools.partial(media_transform, fps=2.0, max_frames=8)
    reader = ShardedManifest(manifest, rank=0, world_size=2, shuffle=False, transform=transform)
    batch = reader.next_batch(3)
    assert [r["i"] for r in batch] == [0, 2, 4]  # rank 0 of 2 owns every other record
    assert MEDIA_STATS["images"] == 3 and MEDIA_STATS["videos"] == 3
    assert all(isinstance(r["image"], Image.Image) for r in batch)
    assert batch[0]["video"].shape == (4, 56, 56, 3) and batch[0]["video_fps"] == pytest.approx(2.0)
    assert batch[0]["image_path"] == "media/0.png"  # relative to the manifest, kept for logs
    assert MEDIA_STATS["bytes"] == 3 * 56 * 56 * 3 + 3 * 4 * 56 * 56 * 3


def test_media_transform_error_names_file_and_line(tmp_path):
    manifest = _write_manifest(tmp_path, n=2)
    (tmp_path / "media" / "1.png").unlink()
    reader = ShardedManifest(
        manifest, shuffle=False, transform=functools.partial(media_transform, fps=2.0)
    )
    with pytest.raises(ManifestError, match=r"data\.jsonl:2.*1\.png"):
        reader.next_batch(2)
