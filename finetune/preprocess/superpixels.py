"""Superpixels for the CAST image encoder (F-CAST 3.1, appendix B; CAST's data pipeline).

Three methods, chosen by ``superpixels.method``:

- ``slic``: scikit-image's SLIC (``skimage.segmentation.slic``), the default that installs everywhere;
- ``seeds``: OpenCV's SEEDS (``cv2.ximgproc``), CAST's choice, with CAST's settings (LAB image, 1 level,
  prior 2, 15 histogram bins, 20 iterations); it needs the contrib build of OpenCV;
- ``sfcn``: the fully convolutional superpixel network of Yang et al. (2020), F-CAST's choice (appendix B),
  in torch (:class:`SpixelNet`), with weights from the checkpoint the recipe names.

Every method returns labels ``(H, W)`` int64 numbered ``0 .. S-1`` without gaps, computed on the image
exactly as the encoder sees it (:func:`encoder_view`: the resize and centre crop). Three ways keep them off a
training step's critical path:

- :func:`compute_superpixels_batch`: a batch of images at once; SFCN runs as one forward of the network on any
  device (a GPU), with the same labels as one image at a time (tested); SLIC and SEEDS are per-image CPU
  algorithms and loop;
- :class:`SuperpixelCache`: on disk, keyed by the image bytes and the method's settings, so that map-style data
  computes each image's superpixels once (in the data workers) and later epochs read them back;
- a webdataset entry ``KEY.superpixels.png`` (:data:`ENTRY`) that ``xlipkit superpixels``
  (:mod:`finetune.cli.superpixels`) writes once into a copy of a stream's shards: the labels as a lossless PNG
  with a stamp of the settings that made them (:func:`settings_stamp`), read back by the stream
  (:func:`decode_entry`) so that the data workers do no superpixel work.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

METHODS = ("slic", "seeds", "sfcn")
#: bump when a method's output changes (part of every cache key and of every shard entry's stamp)
CODE_VERSION = "1"
#: the webdataset entry (``KEY.superpixels.png``) that holds a sample's precomputed superpixels
ENTRY = "superpixels.png"
#: the PNG text chunk of an entry that holds its :func:`settings_stamp`
STAMP_CHUNK = "xlipkit-superpixels"


@dataclass(frozen=True)
class SuperpixelSettings:
    """How superpixels are computed (the recipe's ``model`` config of an ``fcast`` model).

    Attributes:
        method: ``slic`` | ``seeds`` | ``sfcn``.
        n_segments: target number of superpixels (196 at 224 px, F-CAST 3.1).
        compactness: SLIC's colour/space trade-off (scikit-image's default 10).
        checkpoint: SFCN weights (``.safetensors``, or a ``.pt``/``.pth``/``.tar`` read with
            ``torch.load(weights_only=True)``); required for ``sfcn``.
    """

    method: str = "slic"
    n_segments: int = 196
    compactness: float = 10.0
    checkpoint: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"superpixels.method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.n_segments < 1:
            raise ValueError(f"superpixels.n_segments must be >= 1, got {self.n_segments}")
        if self.method == "sfcn" and not self.checkpoint:
            raise ValueError("superpixels.method sfcn needs superpixels.checkpoint: the SFCN weights "
                             "(.safetensors, or the authors' .tar read with torch.load(weights_only=True))")


def relabel(labels: np.ndarray) -> np.ndarray:
    """Labels renumbered ``0 .. S-1`` in order of first value (``np.unique``), int64, same shape."""
    _, inverse = np.unique(labels, return_inverse=True)
    return inverse.reshape(labels.shape).astype(np.int64)


def relabel_batch(labels: Tensor, n_values: int) -> Tensor:
    """:func:`relabel` of every row of a batch where the labels are (a GPU: no host read): ``(B, H, W)`` int64 in
    ``[0, n_values)`` -> ``(B, H, W)`` int64, each row renumbered ``0 .. S_b-1`` in order of value."""
    b = labels.shape[0]
    flat = labels.reshape(b, -1)
    present = torch.zeros(b, n_values, dtype=torch.long, device=labels.device).scatter_(1, flat, 1)
    return (present.cumsum(1) - 1).gather(1, flat).reshape(labels.shape)


def encoder_view(image: Any, side: int) -> np.ndarray:
    """The image as the CAST encoder sees it, on which its superpixels are computed: RGB, the shortest side resized
    to ``side`` (bicubic), the centre ``side x side`` crop -> ``(side, side, 3)`` uint8.

    Args:
        image: a PIL image (any mode).
        side: the encoder's input side (``FCastModel.image_size``).
    """
    from PIL import Image

    img = image.convert("RGB")
    w, h = img.size
    scale = side / min(w, h)
    img = img.resize((max(side, round(w * scale)), max(side, round(h * scale))), Image.BICUBIC)
    w, h = img.size
    left, top = (w - side) // 2, (h - side) // 2
    return np.asarray(img.crop((left, top, left + side, top + side)), dtype=np.uint8)


def slic_superpixels(image: np.ndarray, n_segments: int = 196, compactness: float = 10.0) -> np.ndarray:
    """SLIC superpixels of an RGB uint8 image ``(H, W, 3)`` -> labels ``(H, W)`` int64 (scikit-image)."""
    from skimage.segmentation import slic

    labels = slic(image, n_segments=n_segments, compactness=compactness, start_label=0, channel_axis=-1)
    return relabel(labels)


def seeds_superpixels(image: np.ndarray, n_segments: int = 196) -> np.ndarray:
    """SEEDS superpixels with CAST's settings (``num_levels=1, prior=2, histogram_bins=15,
    double_step=False``, 20 iterations on the LAB image) of an RGB uint8 image ``(H, W, 3)``.

    Raises:
        ImportError: the installed OpenCV has no ``cv2.ximgproc`` (install opencv-contrib-python-headless).
    """
    import cv2

    if not hasattr(cv2, "ximgproc"):
        raise ImportError("superpixels.method seeds needs OpenCV's contrib module cv2.ximgproc, which the installed "
                          "OpenCV lacks: pip install opencv-contrib-python-headless (in place of opencv-python), "
                          "or use superpixels.method slic")
    h, w = image.shape[:2]
    lab = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2LAB)
    seeds = cv2.ximgproc.createSuperpixelSEEDS(w, h, 3, n_segments, 1, 2, 15, False)
    seeds.iterate(lab, 20)
    return relabel(seeds.getLabels())


# -- SFCN (Yang et al., 2020) -------------------------------------------------------------------------
def _conv(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.LeakyReLU(0.1))


def _deconv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, 4, 2, 1, bias=True), nn.LeakyReLU(0.1))


class SpixelNet(nn.Module):
    """The fully convolutional superpixel network of Yang et al. (2020) ("SpixelNet", SFCN).

    An encoder of five levels (two 3x3 conv + BN + LeakyReLU(0.1) each; channels 16, 32, 64, 128, 256,
    stride 2 between levels) and a decoder of transposed convolutions with skip connections back to full
    resolution, ending in a 3x3 convolution to 9 channels and a softmax: each pixel's association ``Q``
    with the 9 grid cells around its own (cell size = image side / sqrt(n_segments), 16 at 224 px and 196
    segments). Submodule names follow the authors' release so that their weights load.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv0a, self.conv0b = _conv(3, 16), _conv(16, 16)
        self.conv1a, self.conv1b = _conv(16, 32, 2), _conv(32, 32)
        self.conv2a, self.conv2b = _conv(32, 64, 2), _conv(64, 64)
        self.conv3a, self.conv3b = _conv(64, 128, 2), _conv(128, 128)
        self.conv4a, self.conv4b = _conv(128, 256, 2), _conv(256, 256)
        self.deconv3, self.conv3_1 = _deconv(256, 128), _conv(256, 128)
        self.deconv2, self.conv2_1 = _deconv(128, 64), _conv(128, 64)
        self.deconv1, self.conv1_1 = _deconv(64, 32), _conv(64, 32)
        self.deconv0, self.conv0_1 = _deconv(32, 16), _conv(32, 16)
        self.pred_mask0 = nn.Conv2d(16, 9, 3, 1, 1, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        """``x (B, 3, H, W)`` (H, W multiples of 16, normalised as the checkpoint expects) -> ``Q (B, 9, H, W)``."""
        c0 = self.conv0b(self.conv0a(x))
        c1 = self.conv1b(self.conv1a(c0))
        c2 = self.conv2b(self.conv2a(c1))
        c3 = self.conv3b(self.conv3a(c2))
        c4 = self.conv4b(self.conv4a(c3))
        d3 = self.conv3_1(torch.cat([c3, self.deconv3(c4)], 1))
        d2 = self.conv2_1(torch.cat([c2, self.deconv2(d3)], 1))
        d1 = self.conv1_1(torch.cat([c1, self.deconv1(d2)], 1))
        d0 = self.conv0_1(torch.cat([c0, self.deconv0(d1)], 1))
        return torch.softmax(self.pred_mask0(d0), dim=1)


def load_spixelnet(path: str | os.PathLike) -> SpixelNet:
    """A :class:`SpixelNet` with the weights at ``path`` (safetensors, or a torch file read with
    ``weights_only=True``; a ``state_dict`` entry and ``module.`` prefixes are unwrapped), in eval mode.

    Raises:
        FileNotFoundError / ValueError: naming ``superpixels.checkpoint`` and what is wrong.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"superpixels.checkpoint {path} does not exist: give the SFCN weights file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
        state = state.get("state_dict", state) if isinstance(state, dict) else state
    state = {k.removeprefix("module."): v for k, v in state.items()}
    net = SpixelNet()
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"superpixels.checkpoint {path} is not an SFCN (SpixelNet) checkpoint: "
                         f"{str(exc).splitlines()[-1].strip()}") from exc
    return net.eval()


def sfcn_labels(assoc: Tensor, n_segments: int = 196) -> Tensor:
    """Hard superpixel labels from SFCN associations (Yang et al. 2020, section 3.1): each pixel goes to the
    neighbouring grid cell (of the 3x3 around its own) with the largest association; cells off the grid
    are never chosen.

    Args:
        assoc: ``(B, 9, H, W)`` associations, neighbour order row-major from (-1, -1) to (+1, +1).
        n_segments: grid cells (a square number's grid: side = round(sqrt(n_segments))).
    Returns:
        ``(B, H, W)`` int64 labels ``row * cols + col`` of the chosen cell.
    """
    b, nine, h, w = assoc.shape
    side = max(int(round(n_segments ** 0.5)), 1)
    cell_h, cell_w = h / side, w / side
    rows = (torch.arange(h, device=assoc.device) / cell_h).floor().long().clamp(max=side - 1)
    cols = (torch.arange(w, device=assoc.device) / cell_w).floor().long().clamp(max=side - 1)
    offsets = torch.tensor([(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1)], device=assoc.device)
    nr = rows[None, :, None] + offsets[:, 0, None, None]  # (9, H, 1)
    nc = cols[None, None, :] + offsets[:, 1, None, None]  # (9, 1, W)
    valid = (nr >= 0) & (nr < side) & (nc >= 0) & (nc < side)  # (9, H, W)
    scores = assoc.masked_fill(~valid[None], -1.0)
    choice = scores.argmax(dim=1)  # (B, H, W)
    label = (nr * side + nc).expand(9, h, w)
    return label[None].expand(b, 9, h, w).gather(1, choice[:, None]).squeeze(1)


_SFCN_CACHE: dict[tuple[str, str], SpixelNet] = {}
#: the authors' input normalisation: RGB in [0, 1] minus this mean
SFCN_MEAN = (0.411, 0.432, 0.45)


def _spixelnet(checkpoint: str, device: torch.device) -> SpixelNet:
    key = (checkpoint, str(device))
    net = _SFCN_CACHE.get(key)
    if net is None:
        net = _SFCN_CACHE.setdefault(key, load_spixelnet(checkpoint).to(device))
    return net


def sfcn_superpixels_batch(images: np.ndarray | Tensor, checkpoint: str, n_segments: int = 196, *,
                           device: str | torch.device | None = None) -> Tensor:
    """SFCN superpixels of a batch in one forward of the network (Yang et al. 2020), on ``device``.

    The labels of each image do not depend on the others in its batch (the network is fully convolutional, in eval
    mode): the same as :func:`sfcn_superpixels` one image at a time. On CUDA the convolutions run in full float32
    (cuDNN's TF32 off), so that a GPU batch computes what the CPU does up to float rounding.

    Args:
        images: ``(B, H, W, 3)`` uint8 RGB (numpy or a tensor, on any device), sides multiples of 16.
        checkpoint: the SFCN weights (loaded once per process and device).
        n_segments: grid cells (a square number: 196 = 14 x 14).
        device: where the network runs (default: where a tensor ``images`` is, else the CPU).
    Returns:
        ``(B, H, W)`` int64 labels on ``device``, each image's numbered ``0 .. S_b-1`` (:func:`relabel_batch`).
    """
    x = torch.from_numpy(np.require(images, requirements=["C", "W"])) if isinstance(images, np.ndarray) else images
    if x.dim() != 4 or x.shape[-1] != 3 or x.dtype != torch.uint8:
        raise ValueError(f"sfcn_superpixels_batch needs RGB uint8 images (B, H, W, 3), got {x.dtype} {tuple(x.shape)}")
    h, w = x.shape[1:3]
    if h % 16 or w % 16:
        raise ValueError(f"superpixels.method sfcn needs image sides that are multiples of 16, got {w}x{h}")
    device = torch.device(device) if device is not None else x.device
    net = _spixelnet(checkpoint, device)
    x = x.to(device).permute(0, 3, 1, 2).float() / 255.0
    x = x - torch.tensor(SFCN_MEAN, device=device)[None, :, None, None]
    side = max(int(round(n_segments ** 0.5)), 1)
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        return relabel_batch(sfcn_labels(net(x), n_segments), side * side)


def sfcn_superpixels(image: np.ndarray, checkpoint: str, n_segments: int = 196) -> np.ndarray:
    """SFCN superpixels of an RGB uint8 image ``(H, W, 3)`` (sides multiples of 16) with the network at
    ``checkpoint`` (loaded once per process), on the CPU; input scaled to [0, 1] minus the mean
    (0.411, 0.432, 0.45), the authors' normalisation."""
    return sfcn_superpixels_batch(np.ascontiguousarray(image)[None], checkpoint, n_segments, device="cpu")[0].numpy()


def compute_superpixels(image: np.ndarray, settings: SuperpixelSettings) -> np.ndarray:
    """Superpixel labels ``(H, W)`` int64 ``0 .. S-1`` of an RGB uint8 image ``(H, W, 3)`` by ``settings``."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"superpixels need an RGB uint8 image (H, W, 3), got {image.dtype} {image.shape}")
    if settings.method == "slic":
        return slic_superpixels(image, settings.n_segments, settings.compactness)
    if settings.method == "seeds":
        return seeds_superpixels(image, settings.n_segments)
    return sfcn_superpixels(image, str(settings.checkpoint), settings.n_segments)


def compute_superpixels_batch(images: Sequence[np.ndarray] | np.ndarray, settings: SuperpixelSettings, *,
                              device: str | torch.device | None = None) -> np.ndarray:
    """Superpixel labels of a batch of RGB uint8 images of one size: ``(B, H, W, 3)`` -> ``(B, H, W)`` int64, each
    image's ``0 .. S-1``, the labels :func:`compute_superpixels` gives one image at a time.

    SFCN runs as one forward of the network on ``device`` (default CPU; a GPU in ``xlipkit superpixels
    --device cuda``). SLIC and SEEDS are per-image CPU algorithms (scikit-image, OpenCV): they loop, and
    ``device`` must be None or the CPU.
    """
    if len(images) == 0:
        raise ValueError("compute_superpixels_batch needs at least one image")
    if settings.method == "sfcn":
        stack = np.stack([np.ascontiguousarray(a) for a in images])
        if stack.ndim != 4 or stack.shape[-1] != 3 or stack.dtype != np.uint8:
            raise ValueError(f"superpixels need RGB uint8 images (B, H, W, 3), got {stack.dtype} {stack.shape}")
        return sfcn_superpixels_batch(stack, str(settings.checkpoint), settings.n_segments,
                                      device=device or "cpu").cpu().numpy()
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"superpixels.method {settings.method} runs on the CPU (scikit-image / OpenCV), not on "
                         f"{device}: only sfcn (a network) runs on a GPU")
    return np.stack([compute_superpixels(np.asarray(a), settings) for a in images])


# -- precomputed entries in shards ------------------------------------------------------------------------------
_DIGESTS: dict[tuple[str, int, int], str] = {}


def checkpoint_digest(path: str | os.PathLike) -> str:
    """sha256 of a checkpoint file (hex), computed once per process and file version: the part of an entry's stamp
    that says which SFCN weights made it, the same on every machine (a cache key's size and mtime are not)."""
    path = Path(path).expanduser()
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def settings_stamp(settings: SuperpixelSettings, image_size: int) -> str:
    """What a precomputed entry must have been made with to stand for on-the-fly superpixels: the method, its
    settings that change the labels (``compactness`` for SLIC, the checkpoint's sha256 for SFCN), the encoder's
    input side and :data:`CODE_VERSION`, as a JSON string (sorted keys)."""
    stamp: dict[str, Any] = {"method": settings.method, "n_segments": settings.n_segments,
                             "image_size": int(image_size), "v": CODE_VERSION}
    if settings.method == "slic":
        stamp["compactness"] = float(settings.compactness)
    if settings.method == "sfcn":
        stamp["checkpoint_sha256"] = checkpoint_digest(str(settings.checkpoint))
    return json.dumps(stamp, sort_keys=True)


def encode_entry(labels: np.ndarray, stamp: str) -> bytes:
    """Labels ``(H, W)`` as a lossless grey PNG (8 bits up to 256 segments, else 16) with ``stamp`` in its text
    chunk :data:`STAMP_CHUNK`: the bytes of a ``KEY.superpixels.png`` entry."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    labels = np.asarray(labels)
    if labels.ndim != 2 or labels.size == 0 or labels.min() < 0 or labels.max() >= 1 << 16:
        raise ValueError(f"a superpixel entry holds 2-D labels in [0, 65536), got shape {labels.shape}")
    dtype = np.uint8 if labels.max() < 256 else np.uint16
    info = PngInfo()
    info.add_text(STAMP_CHUNK, stamp)
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(labels.astype(dtype))).save(buf, "PNG", pnginfo=info)
    return buf.getvalue()


def decode_entry(data: bytes | dict, expected: str | None = None, *, where: str = "") -> np.ndarray:
    """Labels ``(H, W)`` int64 of a ``KEY.superpixels.png`` entry (its bytes, or ``datasets``' ``{"bytes", ...}``).

    Args:
        data: the entry.
        expected: the :func:`settings_stamp` the run computes superpixels with; None: not checked.
        where: the sample and shard, for messages.
    Raises:
        DataError: the entry is not a superpixel PNG, or was made with other settings (naming both and the fix).
    """
    from PIL import Image

    from finetune.data.images import DataError

    raw = data.get("bytes") if isinstance(data, dict) else data
    try:
        img = Image.open(io.BytesIO(raw))
        img.load()
        stamp = img.text.get(STAMP_CHUNK) if hasattr(img, "text") else None
    except Exception as error:  # PIL raises several types for damaged data
        raise DataError(f"{where}: the {ENTRY} entry is not a PNG ({type(error).__name__}: {error}); write the "
                        f"shards again with `xlipkit superpixels`") from error
    if stamp is None:
        raise DataError(f"{where}: the {ENTRY} entry has no {STAMP_CHUNK!r} stamp: it was not written by "
                        f"`xlipkit superpixels`; write the shards again with it")
    if expected is not None and stamp != expected:
        raise DataError(f"{where}: the precomputed superpixels were made with {stamp}, but this run computes them "
                        f"with {expected} (the model's superpixels, objective.terms.fcast.superpixels): run "
                        f"`xlipkit superpixels RECIPE OUT` again with this recipe, or point data.train.urls at the "
                        f"original shards")
    return np.asarray(img).astype(np.int64)


class SuperpixelCache:
    """Superpixel labels on disk, one ``.npy`` (uint16) per image, keyed by the image bytes and the settings;
    written atomically (temp file + ``os.replace``), so parallel data workers can share the folder.

    Args:
        folder: the cache folder (created when needed).
        settings: the :class:`SuperpixelSettings` (part of every key).
    """

    def __init__(self, folder: str | os.PathLike, settings: SuperpixelSettings) -> None:
        self.folder = Path(folder)
        self.settings = settings
        checkpoint = settings.checkpoint
        fingerprint = None
        if checkpoint and Path(checkpoint).is_file():
            stat = Path(checkpoint).stat()
            fingerprint = f"{stat.st_size}-{stat.st_mtime_ns}"
        self._prefix = json.dumps({**asdict(settings), "checkpoint": fingerprint, "v": CODE_VERSION},
                                  sort_keys=True).encode()

    def path(self, image: np.ndarray) -> Path:
        """Where the labels of ``image`` (RGB uint8 ``(H, W, 3)``) live."""
        digest = hashlib.sha1(self._prefix + str(image.shape).encode() + image.tobytes()).hexdigest()
        return self.folder / digest[:2] / f"{digest}.npy"

    def read(self, image: np.ndarray) -> np.ndarray | None:
        """The cached labels of ``image``, or None (not cached, or a damaged entry)."""
        path = self.path(image)
        if path.is_file():
            try:
                return np.load(path).astype(np.int64)
            except (OSError, ValueError):
                return None  # a damaged entry: recomputed
        return None

    def get(self, image: np.ndarray) -> np.ndarray:
        """The labels of ``image``: read back when cached, else computed and stored."""
        labels = self.read(image)
        if labels is None:
            labels = compute_superpixels(image, self.settings)
            self.put(image, labels)
        return labels

    def get_batch(self, images: Sequence[np.ndarray], *, device: str | torch.device | None = None) -> np.ndarray:
        """:meth:`get` of a batch of one size, ``(B, H, W)``: the cached ones read back, the others computed together
        (:func:`compute_superpixels_batch`, one network forward for SFCN) and stored."""
        found = [self.read(a) for a in images]
        missing = [i for i, labels in enumerate(found) if labels is None]
        if missing:
            computed = compute_superpixels_batch([images[i] for i in missing], self.settings, device=device)
            for i, labels in zip(missing, computed):
                self.put(images[i], labels)
                found[i] = labels
        return np.stack(found)

    def put(self, image: np.ndarray, labels: np.ndarray) -> None:
        """Store the labels of ``image`` (atomically: parallel writers of one image leave one whole file)."""
        path = self.path(image)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy.tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, labels.astype(np.uint16))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def settings_from(value: Any) -> SuperpixelSettings:
    """:class:`SuperpixelSettings` from a dict (a recipe / config entry) or an instance."""
    if isinstance(value, SuperpixelSettings):
        return value
    if value is None:
        return SuperpixelSettings()
    if not isinstance(value, dict):
        raise TypeError(f"superpixels must be a mapping (method, n_segments, ...), got {type(value).__name__}")
    known = set(SuperpixelSettings.__dataclass_fields__)
    unknown = set(value) - known
    if unknown:
        raise ValueError(f"superpixels: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return SuperpixelSettings(**value)
