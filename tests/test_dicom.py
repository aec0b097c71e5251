"""`read_image` on DICOM files written by pydicom: modality rescale, window, MONOCHROME1, bit depths, and clear errors."""
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

pydicom = pytest.importorskip("pydicom")
from pydicom.datadict import tag_for_keyword
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate
from pydicom.tag import Tag
from pydicom.uid import ExplicitVRLittleEndian, JPEG2000Lossless, generate_uid

from proton.models.vlm import as_rgb_image, read_image


def write_dicom(path, pixels, photometric="MONOCHROME2", **tags):
    "Write `pixels` ((H, W) uint8/uint16 grey, (H, W, 3) uint8 RGB or (F, H, W) frames) as a minimal DICOM file with `tags`."
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = "1.2.840.10008.5.1.4.1.1.7", generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset(); ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    colour = pixels.ndim == 3 and pixels.shape[2] == 3 and photometric == "RGB"
    bits = pixels.dtype.itemsize * 8
    if pixels.ndim == 3 and not colour: ds.NumberOfFrames = pixels.shape[0]
    ds.Rows, ds.Columns = pixels.shape[-3:-1] if colour else pixels.shape[-2:]
    ds.SamplesPerPixel, ds.PhotometricInterpretation = (3 if colour else 1), photometric
    if colour: ds.PlanarConfiguration = 0
    ds.BitsAllocated = ds.BitsStored = bits; ds.HighBit, ds.PixelRepresentation = bits - 1, 0
    for k, v in tags.items(): setattr(ds, k, v)
    ds.PixelData = pixels.tobytes()
    ds.save_as(path, enforce_file_format=True)
    return path


RAMP16 = np.linspace(0, 65535, 16 * 256).reshape(16, 256).astype(np.uint16)


def test_16_bit_is_stretched_to_every_8_bit_level(tmp_path):
    a = read_image(write_dicom(tmp_path / "r.dcm", RAMP16))
    assert a.dtype == np.uint8 and (a.min(), a.max()) == (0, 255) and len(np.unique(a)) == 256
    assert (np.diff(a.ravel().astype(int)) >= 0).all()  # the gradation keeps its order
    b = read_image(write_dicom(tmp_path / "r12.dcm", (RAMP16 >> 4)))  # 12 bits stored in 16
    assert (b.min(), b.max()) == (0, 255)


def test_monochrome1_is_inverted(tmp_path):
    m2 = read_image(write_dicom(tmp_path / "m2.dcm", RAMP16))
    m1 = read_image(write_dicom(tmp_path / "m1.dcm", RAMP16, "MONOCHROME1"))
    np.testing.assert_array_equal(m1, 255 - m2)
    w1 = read_image(write_dicom(tmp_path / "w1.dcm", RAMP16, "MONOCHROME1", WindowCenter=30000, WindowWidth=2000))
    w2 = read_image(write_dicom(tmp_path / "w2.dcm", RAMP16, WindowCenter=30000, WindowWidth=2000))
    np.testing.assert_array_equal(w1, 255 - w2)  # after the window


def test_the_window_applies_to_rescaled_values(tmp_path):
    stored = np.arange(0, 4096, 4, dtype=np.uint16).reshape(32, 32)
    hu = stored * 2.0 - 1024  # slope 2, intercept -1024
    a = read_image(write_dicom(tmp_path / "ct.dcm", stored, RescaleSlope=2, RescaleIntercept=-1024, WindowCenter=40, WindowWidth=400))
    assert (a[hu <= 40 - 200] == 0).all() and (a[hu > 40 + 199] == 255).all()
    inside = (hu > -150) & (hu < 230)
    np.testing.assert_allclose(a[inside], ((hu[inside] - 39.5) / 399 + .5) * 255, atol=0.5)
    multi = read_image(write_dicom(tmp_path / "ct2.dcm", stored, RescaleSlope=2, RescaleIntercept=-1024,
                                   WindowCenter=[40, 400], WindowWidth=[400, 2000]))
    np.testing.assert_array_equal(multi, a)  # several windows: the first is the default


def test_an_empty_window_is_no_window(tmp_path):
    "WindowCenter and WindowWidth present with no value, as some exports write them: scaled as without a window, min to max."
    stored = RAMP16 >> 4
    plain = read_image(write_dicom(tmp_path / "plain.dcm", stored))
    for k, tags in enumerate([dict(WindowCenter=None, WindowWidth=None), dict(WindowCenter=None, WindowWidth=400), dict(WindowCenter=40, WindowWidth=None)]):
        np.testing.assert_array_equal(read_image(write_dicom(tmp_path / f"empty{k}.dcm", stored, **tags)), plain)


def test_8_bit_grey_and_rgb_go_to_the_models_as_rgb(tmp_path):
    grey = np.arange(256, dtype=np.uint8).reshape(16, 16)
    np.testing.assert_array_equal(read_image(write_dicom(tmp_path / "g.dcm", grey)), grey)  # already full range: unchanged
    rgb = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    np.testing.assert_array_equal(read_image(write_dicom(tmp_path / "c.dcm", rgb, "RGB")), rgb)
    assert as_rgb_image(read_image(tmp_path / "g.dcm")).size == (16, 16)


def test_8_bit_grey_without_a_window_is_read_as_stored(tmp_path):
    grey = np.arange(40, 200, dtype=np.uint8).reshape(10, 16)  # a dark, low-contrast radiograph saved in 8 bits, as RSNA's are
    np.testing.assert_array_equal(read_image(write_dicom(tmp_path / "g.dcm", grey)), grey)  # as a PNG of it would be: not stretched
    np.testing.assert_array_equal(read_image(write_dicom(tmp_path / "g1.dcm", grey, "MONOCHROME1")), 255 - grey)
    stretched = read_image(write_dicom(tmp_path / "r.dcm", grey, RescaleSlope=2, RescaleIntercept=-10))  # rescaled: no display range is known
    assert (stretched.min(), stretched.max()) == (0, 255)


def test_ycbcr_colour_is_read_as_rgb(tmp_path):
    "pydicom 2 gave YBR_FULL pixels as stored, which were read as RGB: red came out blue. The data extra needs pydicom 3, which converts them."
    path = write_dicom(tmp_path / "ybr.dcm", np.tile(np.uint8([76, 85, 255]), (8, 8, 1)), "RGB")  # pure red in full-range YCbCr
    ds = pydicom.dcmread(path); ds.PhotometricInterpretation = "YBR_FULL"; ds.save_as(path)
    assert np.abs(read_image(path)[0, 0].astype(int) - [255, 0, 0]).max() <= 2
    pins = re.findall(r"pydicom\S*", (Path(__file__).parents[1] / "settings.ini").read_text())
    assert pins and all(p == "pydicom>=3" for p in pins), f"every extra that installs pydicom needs 3 or later, which the reading relies on: {pins}"


@pytest.mark.parametrize("bits", [1, 4, 6])
def test_fewer_than_8_bits_stored_span_every_grey_level(tmp_path, bits):
    "pydicom gives uint8 for any BitsStored up to 8; they were taken as 8-bit grey levels, a 1-bit mask's white as 1/255, while the same values in 16 bits are stretched."
    top = 2 ** bits - 1
    pixels = (np.arange(32 * 32) % (top + 1)).reshape(32, 32).astype(np.uint8)
    path, wide = write_dicom(tmp_path / "low.dcm", pixels), write_dicom(tmp_path / "wide.dcm", pixels.astype(np.uint16))
    for p in (path, wide):
        ds = pydicom.dcmread(p); ds.BitsStored, ds.HighBit = bits, bits - 1
        if bits == 1 and p == path: ds.BitsAllocated, ds.PixelData = 1, np.packbits(pixels.ravel(), bitorder="little").tobytes()  # a mask
        ds.save_as(p)
    a = read_image(path)
    np.testing.assert_array_equal(a, np.round(pixels * (255 / top)).astype(np.uint8))
    np.testing.assert_array_equal(a, read_image(wide))
    if bits > 1:  # MONOCHROME1: inverted after the scaling
        np.testing.assert_array_equal(read_image(write_dicom(tmp_path / "m1.dcm", pixels, "MONOCHROME1", BitsStored=bits, HighBit=bits - 1)), 255 - a)


def write_palette_dicom(path, indices, lut, bits=16):
    "Write the (H, W) uint8 palette `indices` with the colour lookup table `lut` ((K, 3) entries of `bits` bits) as a PALETTE COLOR file."
    ds = pydicom.dcmread(write_dicom(path, indices, "PALETTE COLOR"))
    for k, colour in enumerate(("Red", "Green", "Blue")):
        ds[f"{colour}PaletteColorLookupTableDescriptor"] = pydicom.DataElement(0x00281101 + k, "US", [len(lut), 0, bits])
        ds[f"{colour}PaletteColorLookupTableData"] = pydicom.DataElement(0x00281201 + k, "OW", lut[:, k].astype(f"<u{bits // 8}").tobytes())
    ds.save_as(path)
    return path


def test_palette_colour_is_read_through_its_lookup_table(tmp_path):
    "PALETTE COLOR pixels are indices into the file's colour table: the image is the table's colours, in 8 bits as other colour files are."
    indices = np.array([[0, 1], [2, 3]], dtype=np.uint8).repeat(4, 0).repeat(4, 1)
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255]])  # red, green, blue, white
    expected = colours[indices].astype(np.uint8)
    np.testing.assert_array_equal(read_image(write_palette_dicom(tmp_path / "p16.dcm", indices, colours * 257)), expected)
    np.testing.assert_array_equal(read_image(write_palette_dicom(tmp_path / "p8.dcm", indices, colours, bits=8)), expected)
    assert np.asarray(as_rgb_image(read_image(tmp_path / "p16.dcm")))[0, 0].tolist() == [255, 0, 0]
    with pytest.raises(ValueError, match="PALETTE COLOR.*lookup table"): read_image(write_dicom(tmp_path / "nolut.dcm", indices, "PALETTE COLOR"))


def test_errors_name_the_problem(tmp_path, monkeypatch):
    frames = write_dicom(tmp_path / "frames.dcm", np.zeros((3, 8, 8), dtype=np.uint16))
    with pytest.raises(ValueError, match="frames"): read_image(frames)
    (tmp_path / "bad.dcm").write_bytes(b"not a DICOM file")
    with pytest.raises(ValueError, match="cannot read DICOM file"): read_image(tmp_path / "bad.dcm")
    j2k = pydicom.dcmread(frames)  # JPEG 2000 whose codestream is cut short: every decoder plugin fails, each on a line of its own
    j2k.NumberOfFrames, j2k.file_meta.TransferSyntaxUID = 1, JPEG2000Lossless
    j2k.PixelData = encapsulate([b"\xff\x4f\xff\x51" + bytes(100)]); j2k["PixelData"].VR = "OB"
    j2k.save_as(tmp_path / "cut.dcm", enforce_file_format=True)
    with pytest.raises(ValueError, match="cannot decode the DICOM pixel data") as e: read_image(tmp_path / "cut.dcm")
    assert "\n" not in str(e.value), "one line, as warnings and the command print it"
    monkeypatch.setitem(sys.modules, "pydicom", None)
    with pytest.raises(ImportError, match=r'pip install "proton-ood\[data\]"'): read_image(frames)


def with_raw_tag(path, keyword, raw):
    "`path` with the element `keyword` holding the bytes `raw`, unchecked, as a faulty export writes it."
    ds, tag = pydicom.dcmread(path), Tag(tag_for_keyword(keyword))
    raw += b" " * (len(raw) % 2)  # elements have an even length
    ds[tag] = RawDataElement(tag, pydicom.datadict.dictionary_VR(tag), len(raw), raw, 0, False, True)
    ds.save_as(path)
    return path


def test_a_rescale_with_two_values_or_no_finite_value_is_named_with_its_file_and_tag(tmp_path):
    "RescaleSlope and RescaleIntercept hold one number (VM 1): [1, 1] has no agreed reading, nan or inf would make the image black."
    for k, (keyword, raw) in enumerate([("RescaleSlope", b"1\\1"), ("RescaleIntercept", b"0\\-1024"), ("RescaleSlope", b"nan"), ("RescaleIntercept", b"inf")]):
        path = with_raw_tag(write_dicom(tmp_path / f"IM00000{k}", RAMP16 >> 4), keyword, raw)
        with pytest.raises(ValueError, match=f"IM00000{k}.*{keyword}"): read_image(path)


NUMBER_TAGS = ["RescaleSlope", "RescaleIntercept", "WindowCenter", "WindowWidth", "NumberOfFrames", "SamplesPerPixel"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keyword=st.sampled_from(NUMBER_TAGS), value=st.one_of(st.text(alphabet="0123456789.-+eEnaif \\", max_size=12).map(str.encode), st.binary(max_size=8)))
@example(keyword="RescaleSlope", value=b"1\\1")
def test_a_malformed_number_in_any_tag_read_is_a_value_error_naming_the_file(tmp_path, keyword, value):
    "Any value in the tags the reading uses gives an image or a ValueError naming the file, which a stream leaves out with a warning: never another error."
    path = with_raw_tag(write_dicom(tmp_path / "IM000001", RAMP16 >> 4, WindowCenter=2000, WindowWidth=1000), keyword, value)
    try: assert read_image(path).dtype == np.uint8
    except ValueError as e: assert str(path) in str(e), str(e)


@pytest.mark.parametrize("tags", [dict(RescaleSlope="1e308"), dict(RescaleSlope="1e-320"),
                                  dict(RescaleIntercept="1e308", RescaleSlope="-1e308")])
def test_a_rescale_beyond_floating_point_is_named_not_read_as_a_black_image(tmp_path, tags):
    "Finite but absurd rescale values overflowed the arithmetic: the image came out black or flat with only numpy's RuntimeWarnings."
    path = write_dicom(tmp_path / "IM000001", RAMP16 >> 4, **tags)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warnings are no answer either
        with pytest.raises(ValueError, match="IM000001.*rescale"): read_image(path)


@pytest.mark.parametrize("version", ["2.4.4", "1.4.2"])
def test_a_pydicom_before_3_is_named_not_used(tmp_path, monkeypatch, version):
    "The data extra pins pydicom>=3, but an environment may hold 2.x: YCbCr then read with wrong colours, silently, and a palette file failed with a raw ModuleNotFoundError."
    path = write_dicom(tmp_path / "grey.dcm", np.zeros((8, 8), dtype=np.uint8))
    monkeypatch.setattr(pydicom, "__version__", version)
    with pytest.raises(ImportError, match=re.escape(f'needs pydicom 3 or later, found {version}: pip install "pydicom>=3"')): read_image(path)
