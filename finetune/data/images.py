"""Robust image reading: every image becomes an 8-bit RGB ``PIL.Image``.

Datasets in the wild hold RGBA and palette PNGs, CMYK and grayscale JPEGs, 16-bit medical or
scientific PNGs, 1-bit masks, EXIF-rotated phone photos, and now and then an empty or corrupt
file. :func:`read_image` turns all of them into the RGB image a CLIP processor expects, and
:func:`probe_image` checks a file cheaply (header, size and PIL ``verify()``, no full decode) so
that a data source can validate 10k+ examples quickly before training.

Transparent pixels are composited on white (the usual choice for product photos and icons, and
what a viewer shows); 16-bit and 32-bit integer images are scaled to 8 bits over their range
instead of clipped, which would turn most 16-bit images white.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageOps

__all__ = [
    "DataError",
    "ImageReadError",
    "ImageInfo",
    "read_image",
    "probe_image",
    "to_rgb",
    "IMAGE_EXTENSIONS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "max_image_pixels",
    "set_max_image_pixels",
]

# PIL's own default (``PIL.Image.MAX_IMAGE_PIXELS``): about 0.25 GB of RGB pixels, 1024 MiB as RGBA.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
_max_pixels = DEFAULT_MAX_IMAGE_PIXELS

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".jpe", ".jfif", ".ppm", ".pgm"}
)

# Modes whose plain ``convert("RGB")`` is already right (no alpha, 8-bit channels).
_PLAIN_MODES = frozenset({"RGB", "L", "1", "P", "CMYK", "YCbCr"})
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})


class DataError(ValueError):
    """A data problem: an unreadable image, an empty caption, a bad source spec.

    Re-exported as ``finetune.data.sources.DataError``; it lives here so that
    :class:`ImageReadError` can derive from it without a circular import.
    """


class ImageReadError(DataError):
    """An image that cannot be read: missing, empty (0 bytes) or corrupt.

    Attributes:
        path: the file the image came from, or ``"<bytes>"`` / ``"<PIL image>"``.
        reason: a short description (``"file not found"``, ``"empty file (0 bytes)"``, ...).
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot read image {path}: {reason}")


@dataclass(frozen=True)
class ImageInfo:
    """What :func:`probe_image` learns from an image's header.

    Attributes:
        mode: the PIL mode as stored (``"RGB"``, ``"RGBA"``, ``"I;16"``, ...).
        size: ``(width, height)`` in pixels.
        needs_conversion: True when a plain ``convert("RGB")`` would be wrong (alpha or
            transparency to composite, more than 8 bits per channel, an unusual mode), so that
            a dataset should store the image as :func:`read_image` returns it.
    """

    mode: str
    size: tuple[int, int]
    needs_conversion: bool


def max_image_pixels() -> int:
    """The largest accepted image (width x height) in this process (``data.max_image_pixels``)."""
    return _max_pixels


def set_max_image_pixels(limit: int) -> None:
    """Accept images of up to ``limit`` pixels (width x height) in this process and its workers.

    A larger image is an :class:`ImageReadError` ("too large"), which data sources skip or raise
    per ``data.on_error``, instead of PIL's ``DecompressionBombError`` stopping the run. PIL's own
    limit is raised to match, so that PIL never refuses an image this check accepts. Set once at
    the start of a run (DataLoader workers forked later inherit it).

    Args:
        limit: pixels, >= 1 (the recipe's ``data.max_image_pixels``; default
            :data:`DEFAULT_MAX_IMAGE_PIXELS`, PIL's default).
    Raises:
        ValueError: when ``limit`` is not a positive integer.
    """
    global _max_pixels
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"data.max_image_pixels must be a positive integer, got {limit!r}")
    _max_pixels = limit
    PIL.Image.MAX_IMAGE_PIXELS = max(limit, DEFAULT_MAX_IMAGE_PIXELS)


def _check_size(image: PIL.Image.Image, where: str) -> None:
    width, height = image.size
    if width * height > _max_pixels:
        raise ImageReadError(
            where,
            f"too large ({width}x{height} = {width * height:,} pixels, more than data.max_image_pixels="
            f"{_max_pixels:,}; raise data.max_image_pixels to accept it)",
        )


def _jpeg_ends_cleanly(image: PIL.Image.Image) -> bool:
    """False when a JPEG file has no end-of-image marker (FF D9) at its end: likely truncated.

    A cheap check (reads the last bytes only) that lets header validation find truncated JPEG
    bodies, which ``verify()`` does not; a file that fails it is fully decoded to be sure (some
    cameras write bytes after the marker)."""
    if image.format != "JPEG":
        return True
    handle = getattr(image, "fp", None)
    if handle is None:
        return True
    try:
        position = handle.tell()
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - 64))
        tail = handle.read(64).rstrip(b"\x00\r\n ")
        handle.seek(position)
    except (OSError, ValueError):
        return True
    return tail.endswith(b"\xff\xd9")


def _describe(src: Any) -> str:
    if isinstance(src, (str, os.PathLike)):
        return os.fspath(src)
    if isinstance(src, dict):
        path = src.get("path")
        return str(path) if path else "<bytes>"
    if isinstance(src, PIL.Image.Image):
        return getattr(src, "filename", "") or "<PIL image>"
    return "<bytes>"


def _open(src: str | os.PathLike | bytes | bytearray | memoryview | dict) -> tuple[PIL.Image.Image, str]:
    """Open ``src`` lazily (header only); raise :class:`ImageReadError` on missing/empty/corrupt."""
    where = _describe(src)
    if isinstance(src, dict):
        data, path = src.get("bytes"), src.get("path")
        if data is not None:
            src = data
        elif path:
            src = path
        else:
            raise ImageReadError(where, "the example has neither image bytes nor an image path")
    if isinstance(src, (str, os.PathLike)):
        path = Path(os.fspath(src)).expanduser()
        if not path.is_file():
            reason = "is a directory, not an image file" if path.is_dir() else "file not found"
            raise ImageReadError(where, reason)
        if path.stat().st_size == 0:
            raise ImageReadError(where, "empty file (0 bytes)")
        try:
            return _open_quietly(path), where
        except PIL.Image.DecompressionBombError as error:
            raise ImageReadError(where, _too_large(error)) from error
        except (PIL.UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
            raise ImageReadError(where, f"not a readable image ({error})") from error
    if isinstance(src, (bytes, bytearray, memoryview)):
        if len(src) == 0:
            raise ImageReadError(where, "empty image bytes (0 bytes)")
        try:
            return _open_quietly(io.BytesIO(bytes(src))), where
        except PIL.Image.DecompressionBombError as error:
            raise ImageReadError(where, _too_large(error)) from error
        except (PIL.UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
            raise ImageReadError(where, f"not a readable image ({error})") from error
    raise TypeError(
        f"an image must be a file path, bytes, a {{'bytes', 'path'}} dict or a PIL image; got {type(src).__name__}"
    )


def _too_large(error: Exception) -> str:
    return (f"too large (more than data.max_image_pixels={_max_pixels:,} pixels; raise data.max_image_pixels "
            f"to accept it; PIL: {error})")


def _open_quietly(src: Any) -> PIL.Image.Image:
    """``PIL.Image.open`` without PIL's decompression-bomb warning: :func:`_check_size` decides."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        return PIL.Image.open(src)


def _needs_conversion(image: PIL.Image.Image) -> bool:
    if image.mode not in _PLAIN_MODES:
        return True
    return "transparency" in image.info


def probe_image(src: str | os.PathLike | bytes | dict | PIL.Image.Image) -> ImageInfo:
    """Check that an image is present and well-formed without decoding its pixels.

    Reads the header, checks the size against :func:`max_image_pixels` and runs PIL's
    ``verify()`` (which checks PNG chunk CRCs and structure; for JPEG it checks little beyond the
    header). A JPEG whose file does not end with the end-of-image marker is decoded in full, so a
    truncated JPEG body is found here too; other damage inside a JPEG body is only found by
    :func:`read_image`.

    Args:
        src: a path, encoded bytes, a ``datasets.Image(decode=False)`` dict ``{"bytes", "path"}``
            or a PIL image.
    Returns:
        the image's :class:`ImageInfo`.
    Raises:
        ImageReadError: naming the path, when the file is missing, empty, corrupt, truncated
            (JPEG), larger than :func:`max_image_pixels` or has no pixels.
    """
    if isinstance(src, PIL.Image.Image):
        image, where = src, _describe(src)
    else:
        image, where = _open(src)
    try:
        info = ImageInfo(mode=image.mode, size=tuple(image.size), needs_conversion=_needs_conversion(image))
        if info.size[0] <= 0 or info.size[1] <= 0:
            raise ImageReadError(where, f"the image has no pixels (size {info.size[0]}x{info.size[1]})")
        _check_size(image, where)
        if image is not src:
            suspicious = not _jpeg_ends_cleanly(image)
            image.verify()
            if suspicious:  # no end marker: decode the body to tell a truncated file from trailing bytes
                image.close()
                read_image(src)
    except ImageReadError:
        raise
    except Exception as error:  # PIL raises many types (SyntaxError, struct.error, ...) on bad data
        raise ImageReadError(where, f"corrupt image data ({type(error).__name__}: {error})") from error
    finally:
        if image is not src:
            image.close()
    return info


def _scale_to_uint8(image: PIL.Image.Image) -> PIL.Image.Image:
    """Map a high-bit-depth single-channel image (I;16*, I, F) to mode ``L`` over its range."""
    array = np.asarray(image)
    if image.mode in _SIXTEEN_BIT_MODES:
        scaled = array.astype(np.float32) / 257.0  # 65535 -> 255
    elif image.mode == "F":
        values = array.astype(np.float32)
        scaled = values * 255.0 if np.nanmax(values, initial=0.0) <= 1.0 else values
    else:  # "I": 32-bit ints; a 16-bit source opened as "I" has values above 255
        values = array.astype(np.float64)
        scaled = values / 257.0 if values.max(initial=0) > 255 else values
    scaled = np.nan_to_num(scaled, nan=0.0)
    return PIL.Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), mode="L")


def to_rgb(image: PIL.Image.Image, *, background: tuple[int, int, int] = (255, 255, 255)) -> PIL.Image.Image:
    """Convert a decoded PIL image of any mode to 8-bit RGB.

    Alpha (RGBA, LA, PA, palette or grayscale with a transparency key) is composited on
    ``background``; 16-bit (``I;16``), 32-bit (``I``) and float (``F``) images are scaled to 8
    bits; CMYK, YCbCr, palette, grayscale and 1-bit images go through PIL's conversion.

    Args:
        image: a loaded PIL image (H x W, any mode).
        background: the RGB colour transparent pixels are composited on.
    Returns:
        an ``RGB`` image of the same size (the same object when it already is RGB without
        transparency).
    """
    mode = image.mode
    if mode == "RGB" and "transparency" not in image.info:
        return image
    if mode in _SIXTEEN_BIT_MODES or mode in ("I", "F"):
        return _scale_to_uint8(image).convert("RGB")
    if mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        canvas = PIL.Image.new("RGBA", rgba.size, (*background, 255))
        return PIL.Image.alpha_composite(canvas, rgba).convert("RGB")
    return image.convert("RGB")


def read_image(src: str | os.PathLike | bytes | dict | PIL.Image.Image) -> PIL.Image.Image:
    """Read an image from a path, bytes, a ``{"bytes", "path"}`` dict or a PIL image, as RGB.

    Applies the EXIF orientation, then :func:`to_rgb` (RGBA composited on white, palette P/PA,
    CMYK, grayscale L/LA, 16-bit I;16/I, 1-bit all become 8-bit RGB).

    Args:
        src: a file path, encoded image bytes, a ``datasets.Image(decode=False)`` dict or a PIL
            image.
    Returns:
        a fully loaded ``RGB`` PIL image (W x H as stored, after EXIF rotation).
    Raises:
        ImageReadError: naming the path, when the file is missing, empty (0 bytes), corrupt,
            truncated or larger than :func:`max_image_pixels`.
        TypeError: when ``src`` is none of the accepted types.
    """
    if isinstance(src, PIL.Image.Image):
        image, where = src, _describe(src)
    else:
        image, where = _open(src)
    try:
        _check_size(image, where)
        image.load()
        oriented = PIL.ImageOps.exif_transpose(image)
        if oriented is not None:
            image = oriented
        if image.size[0] <= 0 or image.size[1] <= 0:
            raise ImageReadError(where, f"the image has no pixels (size {image.size[0]}x{image.size[1]})")
        return to_rgb(image)
    except ImageReadError:
        raise
    except Exception as error:  # truncated or malformed data surfaces as OSError, SyntaxError, ...
        raise ImageReadError(where, f"corrupt image data ({type(error).__name__}: {error})") from error
