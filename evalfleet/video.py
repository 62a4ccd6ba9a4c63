"""Episode videos: frames rendered by an env, written to MP4 (ffmpeg) or GIF (Pillow).

:class:`VideoSink` takes the frames of one episode and writes the file atomically;
:func:`render_frame` gets one RGB frame from an env; :func:`probe_encoder` checks, before any
episode runs, that this process can write a video at all. Replaying episodes (which frames to
render, and when) stays in ``evalfleet.replay``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from evalfleet.framing import offscreen, rgb_frame
from evalfleet.sandbox.base import error_text

__all__ = [
    "DEFAULT_FPS",
    "HOLD_LAST_S",
    "MAX_GIF_FPS",
    "MAX_GIF_FRAMES",
    "RenderError",
    "VideoSink",
    "mp4_available",
    "probe_encoder",
    "render_frame",
]

#: Frames per second when neither ``fps`` nor the env's ``metadata["render_fps"]`` says.
DEFAULT_FPS = 30
#: Browsers play GIF frames shorter than 20 ms at 100 ms, so GIFs are capped at 50 fps.
MAX_GIF_FPS = 50
#: Frames kept per GIF; longer episodes keep every 2nd, 4th, ... frame (memory stays bounded).
MAX_GIF_FRAMES = 600
#: The final frame is held this long, so the outcome of the episode can be seen.
HOLD_LAST_S = 1.0


def mp4_available() -> bool:
    """True when imageio-ffmpeg (the MP4 encoder) can be imported."""
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


class VideoSink:
    """Frames of one episode on their way to a video file.

    MP4 frames stream straight into ffmpeg, so any episode length fits in memory. GIF frames are
    kept palette-quantised (one byte per pixel); past ``MAX_GIF_FRAMES`` every other kept frame
    is dropped and the stride doubles, so a long episode becomes an evenly sampled, faster GIF.
    """

    def __init__(self, path: Path, fps: float) -> None:
        self.path = path
        self.fps = fps
        self._tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
        self._mp4 = path.suffix == ".mp4"
        self._writer: Any = None
        self._pad: tuple[tuple[int, int], ...] = ((0, 0), (0, 0), (0, 0))
        self._shape: tuple[int, ...] | None = None
        self._last: npt.NDArray[np.uint8] | None = None
        self._gif: list[Any] = []
        self._last_kept = False
        self._stride = max(1, math.ceil(fps / MAX_GIF_FPS))
        self._seen = 0

    def add(self, frame: npt.NDArray[np.uint8]) -> None:
        """Append one frame (padded or cropped to the first frame's size)."""
        if self._shape is None:
            self._shape = frame.shape
        elif frame.shape != self._shape:  # a video has one size: pad or crop to the first frame's
            fixed = np.full(self._shape, 255, dtype=np.uint8)
            h, w = min(frame.shape[0], self._shape[0]), min(frame.shape[1], self._shape[1])
            fixed[:h, :w] = frame[:h, :w]
            frame = fixed
        self._last = frame
        if self._mp4:
            self._send(frame)
        else:
            self._keep_gif(frame)
        self._seen += 1

    def _send(self, frame: npt.NDArray[np.uint8]) -> None:
        if self._writer is None:
            import imageio_ffmpeg

            h, w = frame.shape[:2]
            # yuv420p needs even sizes; pad with the edge colour rather than rescale the picture.
            self._pad = ((0, h % 2), (0, w % 2), (0, 0))
            self._writer = imageio_ffmpeg.write_frames(
                str(self._tmp), (w + w % 2, h + h % 2), fps=self.fps, codec="libx264", quality=7,
                macro_block_size=1, ffmpeg_log_level="error",
            )
            self._writer.send(None)
        self._writer.send(np.ascontiguousarray(np.pad(frame, self._pad, mode="edge")).tobytes())

    def _keep_gif(self, frame: npt.NDArray[np.uint8]) -> None:
        from PIL import Image

        self._last_kept = self._seen % self._stride == 0
        if self._last_kept:
            self._gif.append(Image.fromarray(frame, mode="RGB").quantize(colors=256))
            if len(self._gif) > MAX_GIF_FRAMES:
                self._gif = self._gif[::2]
                self._stride *= 2

    def write(self) -> Path:
        """Finish the file (the last frame held ``HOLD_LAST_S``) and move it into place."""
        if self._last is None:
            raise ValueError("no frames were rendered")
        if self._mp4:
            for _ in range(max(1, round(self.fps * HOLD_LAST_S))):
                self._send(self._last)
            self._writer.close()
            self._writer = None
        else:
            from PIL import Image

            frames = list(self._gif)
            if not self._last_kept:  # always end on the outcome
                frames.append(Image.fromarray(self._last, mode="RGB").quantize(colors=256))
            ms = max(20, round(1000 * self._stride / self.fps))
            durations = [ms] * len(frames)
            durations[-1] = max(ms, round(1000 * HOLD_LAST_S))
            frames[0].save(self._tmp, format="GIF", save_all=True, append_images=frames[1:],
                           duration=durations, loop=0, optimize=False, disposal=1)
        self._tmp.replace(self.path)
        return self.path

    def abort(self) -> None:
        """Drop a half-written video (rendering or writing failed)."""
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # ffmpeg may already be gone; the temp file is removed either way
                pass
            self._writer = None
        self._tmp.unlink(missing_ok=True)



class RenderError(Exception):
    """``render()`` failed or returned something that is not an RGB image."""


def render_frame(env: gym.Env[Any, Any]) -> npt.NDArray[np.uint8]:
    """One ``(H, W, 3)`` uint8 frame of ``env``; raises ``RenderError`` when it renders none."""
    try:
        with offscreen():
            frame = rgb_frame(env.render())
    except Exception as err:
        raise RenderError(error_text(err)) from err
    if frame is None:
        raise RenderError("render() returned no (H, W, 3) image")
    return frame


def probe_encoder(video_format: str = "auto") -> str | None:
    """None when this process can write a short video of ``video_format``, else why not.

    Writes two frames to a temporary file with the writer ``record_episodes`` uses (ffmpeg from
    imageio-ffmpeg for MP4, Pillow for GIF), so a missing or broken encoder is found before any
    episode runs.
    """
    import tempfile

    if video_format == "mp4" and not mp4_available():
        return "the MP4 encoder is missing (imageio-ffmpeg is not installed: pip install imageio-ffmpeg)"
    suffix = ".mp4" if video_format == "mp4" or (video_format == "auto" and mp4_available()) else ".gif"
    with tempfile.TemporaryDirectory(prefix="evalfleet-encoder-") as tmp:
        sink = VideoSink(Path(tmp) / f"probe{suffix}", float(DEFAULT_FPS))
        try:
            frame = np.zeros((16, 16, 3), dtype=np.uint8)
            sink.add(frame)
            sink.add(frame)
            path = sink.write()
            if path.stat().st_size == 0:
                return f"the {suffix[1:].upper()} encoder wrote an empty file"
        except Exception as err:
            sink.abort()
            encoder = "ffmpeg (imageio-ffmpeg)" if suffix == ".mp4" else "Pillow's GIF writer"
            return f"the video encoder {encoder} failed: {error_text(err)}"
    return None
