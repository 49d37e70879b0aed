"""Robust image reading: odd modes become RGB, bad files raise errors naming the path."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image
import pytest
import torch

from finetune.data.images import DataError, ImageReadError, probe_image, read_image, to_rgb


def _png(image: PIL.Image.Image, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **kwargs)
    return buffer.getvalue()


def test_rgba_is_composited_on_white(tmp_path):
    pixels = np.zeros((2, 3, 4), dtype=np.uint8)
    pixels[0, 0] = (255, 0, 0, 255)  # opaque red stays red
    pixels[0, 1] = (255, 0, 0, 0)  # fully transparent becomes white
    pixels[0, 2] = (0, 0, 0, 128)  # half-transparent black becomes mid grey
    path = tmp_path / "rgba.png"
    PIL.Image.fromarray(pixels, mode="RGBA").save(path)

    image = read_image(str(path))

    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) == (255, 0, 0)
    assert image.getpixel((1, 0)) == (255, 255, 255)
    assert all(abs(v - 127) <= 1 for v in image.getpixel((2, 0)))


def test_palette_with_and_without_transparency():
    palette_image = PIL.Image.new("P", (2, 1))
    palette_image.putpalette([0, 0, 255] + [255, 0, 0] + [0, 0, 0] * 254)
    palette_image.putpixel((0, 0), 0)
    palette_image.putpixel((1, 0), 1)
    plain = read_image(_png(palette_image))
    assert plain.mode == "RGB" and plain.getpixel((0, 0)) == (0, 0, 255) and plain.getpixel((1, 0)) == (255, 0, 0)

    keyed = read_image(_png(palette_image, transparency=0))  # palette index 0 is transparent
    assert keyed.getpixel((0, 0)) == (255, 255, 255)
    assert keyed.getpixel((1, 0)) == (255, 0, 0)


def test_cmyk_grayscale_la_and_one_bit():
    cmyk = PIL.Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # no cyan, full magenta+yellow: red
    buffer = io.BytesIO()
    cmyk.save(buffer, format="TIFF")
    assert read_image(buffer.getvalue()).getpixel((1, 1)) == (255, 0, 0)

    gray = read_image(_png(PIL.Image.new("L", (3, 3), 77)))
    assert gray.mode == "RGB" and gray.getpixel((1, 1)) == (77, 77, 77)

    la = read_image(_png(PIL.Image.new("LA", (3, 3), (0, 0))))  # transparent black on white
    assert la.getpixel((0, 0)) == (255, 255, 255)

    bits = PIL.Image.new("1", (2, 1), 0)
    bits.putpixel((1, 0), 1)
    one_bit = read_image(_png(bits))
    assert one_bit.getpixel((0, 0)) == (0, 0, 0) and one_bit.getpixel((1, 0)) == (255, 255, 255)


def test_sixteen_bit_is_scaled_not_clipped(tmp_path):
    values = np.array([[0, 32896, 65535]], dtype=np.uint16)
    path = tmp_path / "deep.png"
    PIL.Image.fromarray(values).save(path)
    assert PIL.Image.open(path).mode.startswith("I")

    image = read_image(path)

    assert image.mode == "RGB"
    assert [image.getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]


def test_thirty_two_bit_and_float_images():
    wide = PIL.Image.fromarray(np.array([[0, 65535]], dtype=np.int32), mode="I")
    assert [to_rgb(wide).getpixel((x, 0)) for x in range(2)] == [(0, 0, 0), (255, 255, 255)]
    small = PIL.Image.fromarray(np.array([[3, 200]], dtype=np.int32), mode="I")
    assert to_rgb(small).getpixel((1, 0)) == (200, 200, 200)  # already 8-bit values: unchanged
    unit = PIL.Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), mode="F")
    assert [to_rgb(unit).getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]


def test_exif_orientation_is_applied():
    image = PIL.Image.new("RGB", (4, 2), (10, 200, 10))
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif.tobytes())

    assert read_image(buffer.getvalue()).size == (2, 4)


def test_dict_and_pil_inputs(tmp_path):
    data = _png(PIL.Image.new("RGB", (5, 4), (1, 2, 3)))
    path = tmp_path / "a.png"
    path.write_bytes(data)

    assert read_image({"bytes": data, "path": None}).size == (5, 4)
    assert read_image({"bytes": None, "path": str(path)}).getpixel((0, 0)) == (1, 2, 3)
    assert read_image(PIL.Image.new("RGBA", (2, 2), (0, 0, 0, 0))).getpixel((0, 0)) == (255, 255, 255)


def test_missing_empty_and_corrupt_files_name_the_path(tmp_path):
    missing = tmp_path / "nope.jpg"
    with pytest.raises(ImageReadError, match="nope.jpg.*not found") as caught:
        read_image(str(missing))
    assert isinstance(caught.value, DataError) and isinstance(caught.value, ValueError)
    assert caught.value.path == str(missing)

    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(ImageReadError, match="empty.png.*0 bytes"):
        read_image(empty)

    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"this is not an image at all")
    with pytest.raises(ImageReadError, match="corrupt.png"):
        read_image(corrupt)
    with pytest.raises(ImageReadError, match="corrupt.png"):
        probe_image(str(corrupt))

    with pytest.raises(ImageReadError, match="neither image bytes nor an image path"):
        read_image({"bytes": None, "path": None})
    with pytest.raises(TypeError, match="got int"):
        read_image(3)


def test_truncated_png_is_caught_by_probe_and_read(tmp_path):
    rng = np.random.default_rng(0)
    data = _png(PIL.Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)))
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(data[: len(data) // 2])

    with pytest.raises(ImageReadError, match="cut.png"):
        probe_image(truncated)
    with pytest.raises(ImageReadError, match="cut.png"):
        read_image(truncated)


def test_probe_reports_mode_size_and_when_conversion_is_needed():
    rgb = probe_image(_png(PIL.Image.new("RGB", (7, 5))))
    assert (rgb.mode, rgb.size, rgb.needs_conversion) == ("RGB", (7, 5), False)
    assert probe_image(_png(PIL.Image.new("L", (2, 2)))).needs_conversion is False
    assert probe_image(_png(PIL.Image.new("RGBA", (2, 2)))).needs_conversion is True
    assert probe_image(_png(PIL.Image.fromarray(np.zeros((2, 2), np.uint16)))).needs_conversion is True
    keyed = PIL.Image.new("P", (2, 2))
    assert probe_image(_png(keyed, transparency=0)).needs_conversion is True


def _jpeg(image: PIL.Image.Image, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90, **kwargs)
    return buffer.getvalue()


def test_read_image_tensor_gives_read_images_pixels(tmp_path):
    """JPEG (RGB, grayscale, EXIF-rotated) through torchvision's decoder, others through read_image: the same
    uint8 pixels as read_image, channels first."""
    from finetune.data.images import read_image_tensor

    rng = np.random.default_rng(1)
    photo = PIL.Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))
    exif = PIL.Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "photo.jpg"
    path.write_bytes(_jpeg(photo))
    rgba = PIL.Image.fromarray(rng.integers(0, 256, (5, 6, 4), dtype=np.uint8), mode="RGBA")
    sources = [str(path), {"bytes": None, "path": str(path)}, _jpeg(photo.convert("L")),
               _jpeg(photo, exif=exif.tobytes()), _png(rgba), photo]
    for src in sources:
        got = read_image_tensor(src)
        want = np.asarray(read_image(src)).transpose(2, 0, 1)
        assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape
        assert np.array_equal(got.numpy(), want)
    assert tuple(read_image_tensor(_jpeg(photo, exif=exif.tobytes())).shape) == (3, 40, 30)


def test_read_image_tensor_names_the_file_of_a_bad_jpeg(tmp_path):
    from finetune.data.images import read_image_tensor

    rng = np.random.default_rng(2)
    data = _jpeg(PIL.Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageReadError, match="cut.jpg"):
        read_image_tensor(cut)
    body = bytearray(data)
    body[len(body) // 2:len(body) // 2 + 200] = b"\xff" * 200  # a damaged body behind a good header
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(bytes(body))
    with pytest.raises(ImageReadError, match="bad.jpg"):
        read_image_tensor(bad)
    with pytest.raises(ImageReadError, match="nope.jpg.*not found"):
        read_image_tensor(tmp_path / "nope.jpg")


def test_jpeg_frame_reads_size_and_components_from_the_header(monkeypatch):
    """The tensor path sizes a JPEG from its start-of-frame segment and decodes it with torchvision (read_image
    is not called); CMYK and other files go through read_image."""
    import finetune.data.images as images
    from finetune.data.images import jpeg_frame, read_image_tensor

    rgb = PIL.Image.new("RGB", (37, 21), (200, 10, 10))
    assert jpeg_frame(_jpeg(rgb)) == (21, 37, 3)
    assert jpeg_frame(_jpeg(rgb.convert("L"))) == (21, 37, 1)
    assert jpeg_frame(_jpeg(rgb, progressive=True)) == (21, 37, 3)
    assert jpeg_frame(_jpeg(rgb.convert("CMYK"))) == (21, 37, 4)
    assert jpeg_frame(_png(rgb)) is None and jpeg_frame(b"\xff\xd8\xff") is None
    real = images.read_image
    monkeypatch.setattr(images, "read_image", lambda src: (_ for _ in ()).throw(AssertionError("PIL path")))
    assert tuple(read_image_tensor(_jpeg(rgb)).shape) == (3, 21, 37)
    monkeypatch.setattr(images, "read_image", real)
    cmyk = read_image_tensor(_jpeg(rgb.convert("CMYK")))
    assert np.array_equal(cmyk.numpy(), np.asarray(read_image(_jpeg(rgb.convert("CMYK")))).transpose(2, 0, 1))


def test_read_image_tensor_refuses_a_jpeg_over_the_pixel_limit():
    from finetune.data.images import max_image_pixels, read_image_tensor, set_max_image_pixels

    before = max_image_pixels()
    set_max_image_pixels(100)
    try:
        with pytest.raises(ImageReadError, match="too large"):
            read_image_tensor(_jpeg(PIL.Image.new("RGB", (20, 10))))
    finally:
        set_max_image_pixels(before)


def test_a_corrupt_file_is_unreadable_even_after_ultralytics_patched_pil(tmp_path):
    # ultralytics replaces PIL.Image.open by a wrapper that pip-installs a HEIF plugin on the first unidentified file
    pytest.importorskip("ultralytics")
    import PIL.Image

    import ultralytics.utils.patches  # noqa: F401  (applies the patch)

    assert PIL.Image.open.__module__ != "PIL.Image"
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"not an image at all" * 10)
    with pytest.raises(ImageReadError, match="corrupt.png.*not a readable image"):
        read_image(corrupt)
    with pytest.raises(ImageReadError, match="not a readable image"):
        read_image(corrupt.read_bytes())
