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
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageOps

from finetune.credentials import mask_text

__all__ = [
    "DataError",
    "ImageReadError",
    "ImageInfo",
    "read_image",
    "read_image_tensor",
    "probe_image",
    "to_rgb",
    "IMAGE_EXTENSIONS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "max_image_pixels",
    "set_max_image_pixels",
    "broken_link_reason",
    "image_files",
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
    :class:`ImageReadError` can derive from it without a circular import. Its message never shows a credential: a
    shard URL's user and password, a signed URL's signature or token, an AWS key id are masked
    (:func:`finetune.credentials.mask_text`) wherever the message names one.
    """

    def __init__(self, *args: Any) -> None:
        if args and isinstance(args[0], str):
            args = (mask_text(args[0]), *args[1:])
        super().__init__(*args)


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
            reason = ("is a directory, not an image file" if path.is_dir()
                      else broken_link_reason(path) or "file not found")
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


def broken_link_reason(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be opened when it is a symbolic link whose target is missing (or a loop of links):
    ``"broken symbolic link (it points to TARGET, which does not exist)"``; None for anything else."""
    path = Path(os.fspath(path)).expanduser()
    if not path.is_symlink() or path.exists():
        return None
    try:
        target = os.readlink(path)
    except OSError:  # pragma: no cover - a link that vanished meanwhile
        target = "?"
    return f"broken symbolic link (it points to {target}, which does not exist)"


def image_files(root: str | os.PathLike) -> list[Path]:
    """The image files under ``root`` (by extension, :data:`IMAGE_EXTENSIONS`), sorted, recursively, with the
    broken symbolic links among them: ``Path.is_file()`` is False for a link whose target is missing, and a
    listing that filters on it would drop such an image without counting it. A data source lists them, and
    validation skips and counts each (:func:`broken_link_reason`) or stops on it (``data.on_error: raise``)."""
    return sorted(p for p in Path(root).rglob("*")
                  if p.suffix.lower() in IMAGE_EXTENSIONS and (p.is_file() or broken_link_reason(p) is not None))


def _too_large(error: Exception) -> str:
    return (f"too large (more than data.max_image_pixels={_max_pixels:,} pixels; raise data.max_image_pixels "
            f"to accept it; PIL: {error})")


def _pil_open() -> Any:
    """PIL's own ``Image.open``. Importing ultralytics (FAST-GOAL's YOLO detector) replaces ``PIL.Image.open`` by a
    wrapper that, on the first file PIL cannot identify, pip-installs and registers a HEIF plugin and retries: a
    corrupt image in a training set would then install a package mid-run, or fail with ``ModuleNotFoundError``
    offline, instead of being reported as unreadable."""
    opener = PIL.Image.open
    if getattr(opener, "__module__", None) == "PIL.Image":
        return opener
    return getattr(sys.modules.get("ultralytics.utils.patches"), "_image_open", opener)


def _open_quietly(src: Any) -> PIL.Image.Image:
    """``PIL.Image.open`` without PIL's decompression-bomb warning: :func:`_check_size` decides."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        return _pil_open()(src)


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


def _encoded_bytes(src: Any) -> bytes:
    """The encoded file of ``src`` (a path, bytes or a ``{"bytes", "path"}`` dict)."""
    if isinstance(src, dict):
        src = src.get("bytes") if src.get("bytes") is not None else src.get("path")
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src)
    return Path(os.fspath(src)).expanduser().read_bytes()


#: JPEG start-of-frame markers (baseline, extended, progressive, lossless; not DHT C4, JPG C8, DAC CC)
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def jpeg_frame(data: bytes) -> tuple[int, int, int] | None:
    """``(height, width, components)`` from a JPEG's start-of-frame segment, walking the marker segments from
    the start (a few dozen bytes, no decode); None when ``data`` is not a JPEG or its header cannot be walked."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        length = (data[i + 2] << 8) | data[i + 3]
        if marker in _SOF:
            if i + 10 > n:
                return None
            return (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8], data[i + 9]
        if marker in (0xD9, 0xDA) or length < 2:  # end of image or scan before any frame
            return None
        i += 2 + length
    return None


def read_image_tensor(src: str | os.PathLike | bytes | dict | PIL.Image.Image) -> "torch.Tensor":
    """:func:`read_image` as a ``uint8 (3, H, W)`` tensor: JPEG files in RGB or grayscale (the bulk of image-text
    data) are decoded by torchvision (``decode_jpeg``, libjpeg-turbo, EXIF orientation applied; the same pixels
    as PIL's decode, about twice as fast, and already channels-first); any other image goes through
    :func:`read_image` (alpha composited on white, 16-bit scaled, CMYK converted).

    Raises:
        ImageReadError: as :func:`read_image`, naming the path.
    """
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    if not isinstance(src, PIL.Image.Image):
        where = _describe(src)
        try:
            data = _encoded_bytes(src)
        except (OSError, TypeError, ValueError):
            data = b""  # missing, a folder, no bytes: read_image names the problem
        frame = jpeg_frame(data) if data else None
        # JPEG with 1 or 3 components (grey, YCbCr or RGB) of an accepted size: torchvision; CMYK and anything
        # else: PIL, through read_image
        if frame is not None and frame[2] in (1, 3) and frame[0] > 0 and frame[1] > 0:
            if frame[0] * frame[1] > _max_pixels:
                raise ImageReadError(where, f"too large ({frame[1]}x{frame[0]} = {frame[0] * frame[1]:,} pixels, "
                                            f"more than data.max_image_pixels={_max_pixels:,}; raise "
                                            "data.max_image_pixels to accept it)")
            try:
                image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB,
                                    apply_exif_orientation=True)
            except (RuntimeError, ValueError, OSError) as error:  # corrupt or truncated body
                raise ImageReadError(where, f"corrupt image data ({type(error).__name__}: {error})") from error
            return image
    return torch.from_numpy(np.array(read_image(src))).permute(2, 0, 1).contiguous()


# -- the tensor path: a model's image geometry on uint8 tensors, normalisation on the device ------------------
#: the most a pixel of :class:`TensorImages` may differ from the model's own processor, in 8-bit levels, and the
#: most the mean difference may be: the transformers torchvision processors give the same values (< 0.001
#: level); a PIL-resizing processor (open_clip's) differs in rounding: on noise images resized 2-10x, at most 2
#: levels, 0.05 on average, 0.01 % of the values by more than 1
TENSOR_PATH_TOLERANCE = 2.0
TENSOR_PATH_MEAN_TOLERANCE = 0.1


@dataclass(frozen=True)
class PixelNorm:
    """The normalisation a model's processor applies after its geometry, ``(x / 255 - mean) / std`` per
    channel; host-side metadata of a batch whose ``pixel_values`` are still ``uint8``
    (:class:`TensorImages`), applied on the device by :meth:`apply`."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def apply(self, pixels: "torch.Tensor") -> "torch.Tensor":
        """``uint8 (B, 3, H, W)`` -> ``float32 (B, 3, H, W)`` normalised, on ``pixels``' device (the per-channel
        constants are made there once and kept, so that a step copies nothing from the host)."""
        import torch

        scale, shift = _norm_constants(self, pixels.device)
        return torch.addcmul(shift, pixels, scale)


_NORM_CACHE: dict[tuple, tuple] = {}


def _norm_constants(norm: PixelNorm, device: Any) -> tuple:
    import torch

    key = (norm, str(device))
    if key not in _NORM_CACHE:
        mean = torch.tensor(norm.mean, dtype=torch.float64)
        std = torch.tensor(norm.std, dtype=torch.float64)
        scale = (1.0 / (255.0 * std)).float().view(3, 1, 1).to(device)
        shift = (-mean / std).float().view(3, 1, 1).to(device)
        _NORM_CACHE[key] = (scale, shift)
    return _NORM_CACHE[key]


class TensorImages:
    """A model's image geometry (:meth:`~finetune.models.core.encoder.DualEncoder.image_transform_params`: shortest
    side resized then centre-cropped, or squashed) with torchvision's v2 functional ops on ``uint8`` tensors,
    batched as ``uint8 (B, 3, H, W)``; the normalisation (:class:`PixelNorm`) is left to the device.

    That is what the transformers torchvision processors compute (resize with antialias on ``uint8``, crop at
    ``int((h - crop) / 2)``), minus their float work on the CPU, and the batch is a quarter of the bytes to
    share between processes and copy to the accelerator. :meth:`for_model` checks it against the model's own
    processor on probe images before it is used (at most :data:`TENSOR_PATH_TOLERANCE` levels apart, on average
    at most :data:`TENSOR_PATH_MEAN_TOLERANCE`).

    Args:
        params: the model's ``image_transform_params()`` (modes ``shortest_center_crop`` and ``squash``).
    """

    MODES = ("shortest_center_crop", "squash")

    def __init__(self, params: dict[str, Any]) -> None:
        from torchvision.transforms import InterpolationMode

        if params.get("mode") not in self.MODES:
            raise ValueError(f"TensorImages covers the modes {self.MODES}, not {params.get('mode')!r}")
        self.mode = params["mode"]
        size = params["size"]
        self.size = size if isinstance(size, int) or self.mode == "squash" else int(size[0])
        self.crop = tuple(params["crop"]) if params.get("crop") else None
        self.round_offset = params.get("crop_offset") == "round"
        self.interpolation = InterpolationMode(str(params.get("resample", "bicubic")).lower())
        self.norm = PixelNorm(tuple(float(v) for v in params["mean"]), tuple(float(v) for v in params["std"]))

    @classmethod
    def for_model(cls, model: Any) -> "TensorImages | None":
        """The tensor path of ``model`` when its geometry is one this class covers and its own
        ``preprocess_images`` agrees on probe images (several sizes and aspect ratios); else None (the
        processor stays in use)."""
        import torch

        params = model.image_transform_params() if hasattr(model, "image_transform_params") else None
        if not params or params.get("mode") not in cls.MODES:
            return None
        try:
            path = cls(params)
            probes = _probe_images()
            reference = model.preprocess_images(probes)
        except (ValueError, KeyError, TypeError):
            return None
        if set(reference) != {"pixel_values"}:  # the model needs more than pixels (F-CAST's superpixels)
            return None
        got = path.norm.apply(path(probes))
        want = reference["pixel_values"].float()
        if got.shape != want.shape:
            return None
        levels = (got - want).abs() * torch.tensor(path.norm.std).view(1, 3, 1, 1) * 255.0
        close = float(levels.max()) <= TENSOR_PATH_TOLERANCE + 1e-3 and float(levels.mean()) <= TENSOR_PATH_MEAN_TOLERANCE
        return path if close else None

    def one(self, image: Any) -> "torch.Tensor":
        """One RGB image (PIL or ``uint8 (3, h, w)``) -> ``uint8 (3, H, W)``."""
        import torch
        import torchvision.transforms.v2.functional as F

        if isinstance(image, PIL.Image.Image):
            image = torch.from_numpy(np.array(to_rgb(image))).permute(2, 0, 1)
        h, w = image.shape[-2:]
        if self.mode == "squash":
            out = tuple(self.size) if not isinstance(self.size, int) else (self.size, self.size)
            return F.resize(image, list(out), interpolation=self.interpolation, antialias=True)
        if h <= w:
            new = (self.size, int(self.size * w / h))
        else:
            new = (int(self.size * h / w), self.size)
        if (h, w) != new:
            image = F.resize(image, list(new), interpolation=self.interpolation, antialias=True)
        if self.crop is None:
            return image
        ch, cw = self.crop
        top, left = (new[0] - ch) / 2.0, (new[1] - cw) / 2.0
        top, left = (int(round(top)), int(round(left))) if self.round_offset else (int(top), int(left))
        if top < 0 or left < 0:  # a crop larger than the resized image: pad as the processors do
            return F.center_crop(image, [ch, cw])
        return image[:, top:top + ch, left:left + cw]

    def __call__(self, images: list[Any]) -> "torch.Tensor":
        """RGB images -> ``uint8 (B, 3, H, W)`` (contiguous; in a data-loader worker, stacked straight into shared
        memory, as ``default_collate`` does, so that handing the batch over copies nothing)."""
        import torch
        from torch.utils.data import get_worker_info

        parts = [self.one(im) for im in images]
        if get_worker_info() is None or not parts:
            return torch.stack(parts)
        first = parts[0]
        storage = first._typed_storage()._new_shared(len(parts) * first.numel(), device=first.device)
        out = first.new(storage).resize_(len(parts), *first.shape)
        return torch.stack(parts, out=out)


def _probe_images() -> list[PIL.Image.Image]:
    """Deterministic RGB probes (gradients, a sharp rectangle, noise) of several sizes and aspect ratios."""
    rng = np.random.default_rng(0)
    out = []
    for w, h in ((224, 224), (300, 200), (157, 411), (640, 480), (33, 47)):
        x = np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, 3))
        y = np.linspace(0, 255, h)[:, None, None]
        a = 0.5 * x + 0.5 * y
        a[h // 4:h // 2, w // 3:w // 2] = (220, 30, 30)
        a = a + rng.normal(0, 20, a.shape)
        out.append(PIL.Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)))
    return out
