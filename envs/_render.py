"""Numpy-only drawing primitives for the ``rgb_array`` frames of the evalfleet environments.

Frames are ``(FRAME_HEIGHT, FRAME_WIDTH, 3)`` uint8 arrays. Text uses a 3x5 pixel font scaled up,
so that labels stay legible in an evaluation video without pygame or a font file.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

FRAME_HEIGHT = 240
FRAME_WIDTH = 320

Frame = NDArray[np.uint8]
Color = tuple[int, int, int]

WHITE: Color = (255, 255, 255)
BLACK: Color = (20, 20, 20)
GREY: Color = (150, 150, 150)
LIGHT_GREY: Color = (225, 225, 225)
RED: Color = (215, 48, 39)
GREEN: Color = (26, 152, 80)
BLUE: Color = (40, 80, 190)
YELLOW: Color = (245, 200, 30)

# Qualitative palette (one colour per topic / series), chosen to stay distinct on video.
PALETTE: tuple[Color, ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)

_GLYPH_ROWS: dict[str, tuple[str, str, str, str, str]] = {
    "0": ("111", "101", "101", "101", "111"),
    "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"),
    "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"),
    "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"),
    "7": ("111", "001", "001", "001", "001"),
    "8": ("111", "101", "111", "101", "111"),
    "9": ("111", "101", "111", "001", "111"),
    "A": ("010", "101", "111", "101", "101"),
    "B": ("110", "101", "110", "101", "110"),
    "C": ("011", "100", "100", "100", "011"),
    "D": ("110", "101", "101", "101", "110"),
    "E": ("111", "100", "110", "100", "111"),
    "F": ("111", "100", "110", "100", "100"),
    "G": ("011", "100", "101", "101", "011"),
    "H": ("101", "101", "111", "101", "101"),
    "I": ("111", "010", "010", "010", "111"),
    "J": ("001", "001", "001", "101", "010"),
    "K": ("101", "101", "110", "101", "101"),
    "L": ("100", "100", "100", "100", "111"),
    "M": ("101", "111", "111", "101", "101"),
    "N": ("110", "101", "101", "101", "101"),
    "O": ("010", "101", "101", "101", "010"),
    "P": ("110", "101", "110", "100", "100"),
    "Q": ("010", "101", "101", "110", "011"),
    "R": ("110", "101", "110", "101", "101"),
    "S": ("011", "100", "010", "001", "110"),
    "T": ("111", "010", "010", "010", "010"),
    "U": ("101", "101", "101", "101", "111"),
    "V": ("101", "101", "101", "101", "010"),
    "W": ("101", "101", "111", "111", "101"),
    "X": ("101", "101", "010", "101", "101"),
    "Y": ("101", "101", "010", "010", "010"),
    "Z": ("111", "001", "010", "100", "111"),
    " ": ("000", "000", "000", "000", "000"),
    ".": ("000", "000", "000", "000", "010"),
    ",": ("000", "000", "000", "010", "100"),
    "-": ("000", "000", "111", "000", "000"),
    "+": ("000", "010", "111", "010", "000"),
    ":": ("000", "010", "000", "010", "000"),
    "/": ("001", "001", "010", "100", "100"),
    "%": ("101", "001", "010", "100", "101"),
    "=": ("000", "111", "000", "111", "000"),
    "(": ("010", "100", "100", "100", "010"),
    ")": ("010", "001", "001", "001", "010"),
    "?": ("111", "001", "010", "000", "010"),
}
_GLYPHS: dict[str, NDArray[np.bool_]] = {
    char: np.array([[bit == "1" for bit in row] for row in rows], dtype=bool)
    for char, rows in _GLYPH_ROWS.items()
}


def blank_frame(color: Color = WHITE) -> Frame:
    """Return a new frame filled with ``color``."""
    frame = np.empty((FRAME_HEIGHT, FRAME_WIDTH, 3), dtype=np.uint8)
    frame[...] = color
    return frame


def fill_rect(frame: Frame, top: int, left: int, height: int, width: int, color: Color) -> None:
    """Fill a rectangle, clipped to the frame; non-positive sizes draw nothing."""
    if height <= 0 or width <= 0:
        return
    bottom = min(frame.shape[0], top + height)
    right = min(frame.shape[1], left + width)
    frame[max(top, 0) : bottom, max(left, 0) : right] = color


def disc_mask(radius: int) -> NDArray[np.bool_]:
    """Boolean mask of a filled disc inside a ``(2r+1, 2r+1)`` square."""
    offsets = np.arange(-radius, radius + 1)
    return (offsets[:, None] ** 2 + offsets[None, :] ** 2) <= radius * radius


def fill_mask(frame: Frame, top: int, left: int, mask: NDArray[np.bool_], color: Color) -> None:
    """Paint ``color`` where ``mask`` is true, with the mask's corner at ``(top, left)``."""
    height, width = mask.shape
    frame[top : top + height, left : left + width][mask] = color


def text_width(text: str, scale: int = 2) -> int:
    """Width in pixels of ``text`` drawn by :func:`draw_text`."""
    return max(0, len(text) * 4 * scale - scale)


def draw_text(
    frame: Frame, top: int, left: int, text: str, color: Color = BLACK, scale: int = 2
) -> None:
    """Draw ``text`` (upper-cased; unknown characters become '?') with the 3x5 font.

    Characters that would fall outside the frame are dropped rather than raising, so long labels
    degrade gracefully.
    """
    block = np.ones((scale, scale), dtype=bool)
    x = left
    for char in text.upper():
        glyph = _GLYPHS.get(char, _GLYPHS["?"])
        if x + 3 * scale > frame.shape[1] or top + 5 * scale > frame.shape[0] or x < 0 or top < 0:
            break
        fill_mask(frame, top, x, np.kron(glyph, block), color)
        x += 4 * scale


def bar(
    frame: Frame,
    top: int,
    left: int,
    height: int,
    width: int,
    fraction: float,
    color: Color,
    background: Color = LIGHT_GREY,
) -> None:
    """Horizontal bar filled to ``fraction`` (clipped to [0, 1]) of its width."""
    fill_rect(frame, top, left, height, width, background)
    filled = int(round(width * min(1.0, max(0.0, fraction))))
    fill_rect(frame, top, left, height, filled, color)
