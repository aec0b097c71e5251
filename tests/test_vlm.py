"""Cross-cutting tests of the VLM protocol: `load_vlm`, an open_clip model with random weights, safe and strict loading, UniMed-CLIP."""
import math
import pathlib
import re

import numpy as np
import pytest
import torch
from PIL import Image
from skimage import data as skdata

from proton.models import MODELS, ALIASES, VLM, load_vlm, class_prompts
from proton.models.vlm import load_weights
from proton.models.unimed import UniMedConfig, UniMedVLM, load_unimed

ARCH = "ViT-S-32"  # the smallest open_clip ViT with a 224 px input: fast to build with random weights
PHOTOS = [skdata.astronaut(), skdata.chelsea(), skdata.retina()]
SMALL = UniMedConfig(embed_dim=32, image_size=32, patch_size=16, vision_width=64, vision_layers=2, vision_heads=2,
                     vocab_size=200, text_width=48, text_layers=2, text_heads=2, text_intermediate=96,
                     max_positions=64, context_length=16)


@pytest.fixture(scope="module")
def clip():
    return load_vlm(f"open_clip:{ARCH}/none")


@pytest.fixture(scope="module")
def photo_embeddings(clip):
    "Embeddings of PHOTOS given as uint8 arrays, in one batch; the reference the other input forms are compared with."
    return clip.encode_images(PHOTOS)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    "A tiny WordPiece vocabulary: special tokens, a few words, single characters and their continuations."
    folder = tmp_path_factory.mktemp("vocab")
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.-")
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "chest", "x", "ray", "normal"] + chars + ["##" + c for c in chars]
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(tokens)) + "\n")
    return folder


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as e: load_vlm("biomedclip")
    assert "unknown VLM 'biomedclip'" in str(e.value)
    for name in ("flair", "unimed-clip", "quiltnet", "open_clip:<arch>/<pretrained>"): assert name in str(e.value)
    assert set(MODELS) | set(ALIASES) >= {"flair", "unimed-clip", "unimed", "quiltnet"}


@pytest.mark.parametrize("name", ["flair", "open_clip:ViT-S-32/none"])
def test_a_device_that_is_not_one_is_named_before_anything_loads(name):
    with pytest.raises(ValueError, match="unknown device 'tpu': use cpu, cuda or cuda:N"): load_vlm(name, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda:1' was asked for, but CUDA is not available here"): load_vlm(name, device="cuda:1")


@pytest.mark.parametrize("name", ["flair", "unimed-clip", "quiltnet", "open_clip:ViT-S-32"])
def test_a_checkpoint_that_is_not_there_is_named_before_anything_loads(name, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint file or folder at .*nope\.pt"): load_vlm(name, tmp_path / "nope.pt")


def test_a_tokenizer_is_refused_by_a_model_that_takes_none():
    with pytest.raises(ValueError, match="a tokenizer is for flair and unimed-clip, not open_clip:ViT-S-32/none"):
        load_vlm("open_clip:ViT-S-32/none", tokenizer="vocab")


def test_a_floating_point_image_file_is_refused_not_clipped(tmp_path, clip):
    "A 32-bit float TIFF (values in [0, 1], as microscopy software writes them) has no agreed range: PIL's conversion would clip it to black."
    from proton.models.vlm import as_rgb_image, read_image
    Image.fromarray(np.linspace(0, 1, 64 * 64, dtype=np.float32).reshape(64, 64)).save(tmp_path / "f.tif")
    image = read_image(tmp_path / "f.tif")
    assert image.mode == "F"
    for convert in (as_rgb_image, clip.preprocess):
        with pytest.raises(ValueError, match=r"floating-point image \(PIL mode F, .*scale it to 8 bits"): convert(image)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
def test_a_grey_image_with_negative_values_is_refused_not_clipped(tmp_path, clip, dtype):
    "CT in Hounsfield units (int16, -1000 for air) went through the bit-depth scaling and then clip(0, 255): every value below 0 became black, unsaid."
    from proton.models.vlm import as_rgb_image, read_image
    ct = np.array([[-100, -50, 0], [40, 100, 120]], dtype)
    message = rf"^a grey image with negative values \({np.dtype(dtype)} from -100 to 120\) has no agreed intensity range .*window it to 0\.\.255 first$"
    with pytest.raises(ValueError, match=message): as_rgb_image(ct)
    with pytest.raises(ValueError, match=message): clip.preprocess(ct)
    Image.fromarray(ct.astype(np.int32)).save(tmp_path / "ct.tif")
    with pytest.raises(ValueError, match=r"^a grey image with negative values \(int32 from -100 to 120\)"): as_rgb_image(read_image(tmp_path / "ct.tif"))
    assert np.asarray(as_rgb_image(np.abs(ct)))[1, 2, 0] == 120  # non-negative: as before


def test_a_wide_grey_array_with_a_channel_axis_is_read_as_grey():
    "(H, W, 1) was squeezed for uint8 but refused for uint16 by 'must be uint8 (or grey uint16), got uint16'."
    from proton.models.vlm import as_rgb_image
    grey = np.arange(16, dtype=np.uint16).reshape(4, 4) * 4000
    assert np.array_equal(np.asarray(as_rgb_image(grey[..., None])), np.asarray(as_rgb_image(grey)))

@pytest.mark.parametrize("image", [np.zeros((0, 0, 3), np.uint8), np.zeros((0, 5), np.uint16), Image.new("RGB", (0, 0))], ids=["rgb", "grey16", "pil"])
def test_an_empty_image_is_named(clip, image):
    "A 0×0 image gave ZeroDivisionError in FLAIR's preprocessing."
    from proton.models.flair import flair_preprocess
    for preprocess in (flair_preprocess, clip.preprocess):
        with pytest.raises(ValueError, match=r"the image is empty \(\d+×\d+ pixels\)"): preprocess(image)


def test_open_clip_attributes(clip):
    assert isinstance(clip, VLM) and clip.name == f"open_clip:{ARCH}/none"
    assert clip.image_size == (224, 224) and clip.device == torch.device("cpu")
    assert clip.temperature == pytest.approx(0.07)  # open_clip's initial logit_scale is log(1/0.07)


def test_pil_and_uint8_inputs_agree(clip, photo_embeddings):
    from_arrays = photo_embeddings
    from_pil = clip.encode_images([Image.fromarray(p) for p in PHOTOS])
    assert from_arrays.shape == (3, clip.dim) and from_arrays.dtype == torch.float32 and from_arrays.device.type == "cpu"
    torch.testing.assert_close(from_pil, from_arrays)
    preprocessed = torch.stack([clip.preprocess(p) for p in PHOTOS])
    torch.testing.assert_close(clip.encode_images(preprocessed), from_arrays)


def test_batch_size_does_not_change_embeddings(clip, photo_embeddings):
    torch.testing.assert_close(clip.encode_images(PHOTOS, batch_size=1), photo_embeddings, atol=1e-5, rtol=0)
    torch.testing.assert_close(clip.encode_images(PHOTOS, batch_size=2), photo_embeddings, atol=1e-5, rtol=0)
    prompts = class_prompts(["cat", "astronaut", "retina"])
    torch.testing.assert_close(clip.encode_text(prompts, batch_size=1), clip.encode_text(prompts), atol=1e-5, rtol=0)


def test_unit_norms(clip, photo_embeddings):
    E, T = photo_embeddings, clip.encode_text(class_prompts(["cat", "dog"]))
    L = clip.encode_local(PHOTOS[:1])
    assert T.shape == (2, clip.dim) and L.shape == (1, 7 * 7, clip.dim)
    for x in (E, T, L): torch.testing.assert_close(x.norm(dim=-1), torch.ones(x.shape[:-1]))


def test_embeddings_are_not_degenerate(clip, photo_embeddings):
    "Different images and prompts give different embeddings (a model that ignored its input would pass the norm tests)."
    E, T = photo_embeddings, clip.encode_text(["a cat", "a retina"])
    assert (E @ E.T - torch.eye(3)).abs().max() < 0.9999
    assert (T[0] @ T[1]).abs() < 0.9999


def test_bad_inputs_are_refused(clip):
    with pytest.raises(ValueError, match="single image"): clip.encode_images(PHOTOS[0])
    with pytest.raises(ValueError, match="must be uint8"): clip.encode_images([PHOTOS[0] / 255.])
    with pytest.raises(ValueError, match=r"\(N, 3, 224, 224\)"): clip.encode_images(torch.zeros(1, 3, 64, 64))
    with pytest.raises(ValueError, match="list of strings"): clip.encode_text("a cat")


@pytest.mark.parametrize("size", [0, -1, 2.5, True, "8", None])
def test_a_batch_size_that_is_no_positive_integer_is_named(clip, size):
    "encode_text(batch_size=0) raised range()'s 'arg 3 must not be zero', 2.5 'float object cannot be interpreted as an integer', True ran batches of one."
    for encode, data in ((clip.encode_images, PHOTOS[:1]), (clip.encode_text, ["a cat"]), (clip.encode_images, torch.zeros(1, 3, 224, 224))):
        with pytest.raises(ValueError, match=rf"^batch_size must be a positive integer, got {re.escape(repr(size))}$"): encode(data, batch_size=size)
    assert len(clip.encode_text(["a", "b", "c"], batch_size=np.int64(2))) == 3  # a numpy integer is an integer

def test_random_weights_follow_the_seed(clip):
    same = load_vlm(f"open_clip:{ARCH}/none", seed=0)
    other = load_vlm(f"open_clip:{ARCH}/none", seed=1)
    torch.testing.assert_close(same.encode_text(["a cat"]), clip.encode_text(["a cat"]))
    assert not torch.allclose(other.encode_text(["a cat"]), clip.encode_text(["a cat"]))


def test_local_weights_file_round_trip(clip, tmp_path):
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in clip.model.state_dict().items()}, tmp_path / "w.safetensors")
    loaded = load_vlm(f"open_clip:{ARCH}", checkpoint=tmp_path / "w.safetensors", seed=1)
    torch.testing.assert_close(loaded.encode_images(PHOTOS[:1]), clip.encode_images(PHOTOS[:1]))


class _TouchOnUnpickle:
    "Unpickling this object creates a file: proof that arbitrary code ran."
    def __init__(self, marker): self.marker = marker
    def __reduce__(self): return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_pickled_objects_are_refused(clip, tmp_path):
    marker = tmp_path / "code-ran"
    sd = dict(clip.model.state_dict())
    torch.save({"state_dict": sd, "hook": _TouchOnUnpickle(marker)}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="refusing to load"): load_vlm(f"open_clip:{ARCH}/{tmp_path / 'evil.pt'}")
    with pytest.raises(ValueError, match="refusing to load"): load_weights(tmp_path / "evil.pt")
    assert not marker.exists()


@pytest.mark.parametrize("wrap", [lambda sd: {"model": sd, "epoch": 1}, lambda sd: {"model_state_dict": sd, "optimizer": {}},
                                  lambda sd: {"module": sd}, lambda sd: {"epoch": 1, "model": {"module." + k: v for k, v in sd.items()}}])
def test_the_common_checkpoint_layouts_are_unwrapped(wrap, tmp_path):
    "{'model': sd, 'epoch': 1} and {'model_state_dict': sd} were refused as having 'entries that are not tensors'."
    sd = dict(torch.nn.Linear(2, 3).state_dict())
    torch.save(wrap(sd), tmp_path / "w.pt")
    loaded = load_weights(tmp_path / "w.pt")
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)


@pytest.mark.parametrize("name", ["W.SAFETENSORS", "w.pt"])
def test_a_safetensors_file_is_known_by_its_header_not_only_its_suffix(name, tmp_path):
    "A safetensors file named W.SAFETENSORS or w.pt was read as a torch file: 'not a torch file of tensors (UnpicklingError)'."
    from safetensors.torch import save_file
    sd = dict(torch.nn.Linear(2, 3).state_dict())
    save_file(sd, tmp_path / name)
    assert load_weights(tmp_path / name).keys() == sd.keys()


def test_a_folder_given_as_a_weights_file_is_called_a_folder(tmp_path):
    "A folder was reported as 'no checkpoint file at <folder>', though the path exists."
    with pytest.raises(IsADirectoryError, match=f"{re.escape(str(tmp_path))} is a folder, not a weights file"): load_weights(tmp_path)


def test_open_clip_strict_loading_names_keys(clip, tmp_path):
    sd = dict(clip.model.state_dict())
    del sd["visual.proj"]
    torch.save(sd, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=r"missing keys \['visual.proj'\]"): load_vlm(f"open_clip:{ARCH}", checkpoint=tmp_path / "partial.pt")


def _snapshot(folder, weights=None, preprocess=None):
    "A folder shaped like a Hugging Face open_clip snapshot of ARCH; `weights(folder)` writes its weights file."
    import json
    import open_clip
    folder.mkdir()
    (folder / "open_clip_config.json").write_text(json.dumps(dict(model_cfg=open_clip.get_model_config(ARCH), preprocess_cfg=preprocess or {})))
    if weights: weights(folder)
    return folder


def test_a_snapshot_folder_loads_as_open_clip_itself_loads_it(clip, tmp_path):
    "The folder's config builds the model and its preprocessing; its weights give the embeddings open_clip's own loader gives."
    import open_clip
    from safetensors.torch import save_file
    from proton.models.vlm import OpenClipVLM
    sd = {k: v.contiguous() for k, v in clip.model.state_dict().items()}
    folder = _snapshot(tmp_path / "snap", lambda d: save_file(sd, d / "open_clip_model.safetensors"), dict(mean=[.5, .5, .5], std=[.25, .25, .25]))
    (folder / "model.safetensors").write_bytes(b"not the file open_clip picks")
    model, _, transform = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    theirs = OpenClipVLM(model, transform, open_clip.get_tokenizer(f"local-dir:{folder}"), "theirs")
    for ours in (load_vlm("quiltnet", folder), load_vlm(f"open_clip:{ARCH}/{folder}")):
        assert torch.equal(ours.encode_images(PHOTOS), theirs.encode_images(PHOTOS))
        assert torch.equal(ours.encode_text(["a cat", "a dog"]), theirs.encode_text(["a cat", "a dog"]))
    assert not torch.equal(theirs.encode_images(PHOTOS), clip.encode_images(PHOTOS))  # the folder's own normalisation was used



def test_weights_that_open_clip_adapts_as_it_loads_them_load_as_it_loads_them(clip, tmp_path):
    "open_clip's load_checkpoint adapts a state before loading it (here a logit_scale saved with shape (1,)); the strict loader refused what open_clip loads."
    import open_clip
    from safetensors.torch import save_file
    from proton.models.vlm import OpenClipVLM
    sd = {k: v.contiguous() for k, v in clip.model.state_dict().items()} | {"logit_scale": clip.model.logit_scale.detach().reshape(1) + 1}
    folder = _snapshot(tmp_path / "snap", lambda d: save_file(sd, d / "open_clip_model.safetensors"), dict(mean=[.5, .5, .5], std=[.25, .25, .25]))
    model, _, transform = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    theirs = OpenClipVLM(model, transform, open_clip.get_tokenizer(f"local-dir:{folder}"), "theirs")
    for ours in (load_vlm("quiltnet", folder), load_vlm(f"open_clip:{ARCH}/{folder / 'open_clip_model.safetensors'}")):
        assert torch.equal(ours.model.logit_scale, theirs.model.logit_scale)
        assert torch.equal(ours.encode_text(["a cat", "a dog"]), theirs.encode_text(["a cat", "a dog"]))

def _truncated(folder, sd):
    from safetensors.torch import save_file
    save_file(sd, folder / "open_clip_model.safetensors")
    data = (folder / "open_clip_model.safetensors").read_bytes()
    (folder / "open_clip_model.safetensors").write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("case,message", [
    ("missing", r"open_clip weights .*snap/open_clip_pytorch_model.bin does not match the model: 1 missing keys \['visual.proj'\]"),
    ("empty", r"open_clip weights .*snap/open_clip_pytorch_model.bin does not match the model: \d+ missing keys"),
    ("pickled", r"refusing to load .*snap/open_clip_pytorch_model.bin as model weights: it holds a pickled open_clip.model.CLIP object"),
    ("truncated", r".*snap/open_clip_model.safetensors is not a valid safetensors file")])
def test_a_snapshot_folder_with_bad_weights_is_refused_in_one_line_naming_the_file(clip, tmp_path, case, message):
    "Snapshot folders went through open_clip's own loader: a RuntimeError naming no file, StopIteration for an empty dict, an UnpicklingError advising to unpickle, a SafetensorError."
    sd = dict(clip.model.state_dict())
    write = dict(missing=lambda d: torch.save({k: v for k, v in sd.items() if k != "visual.proj"}, d / "open_clip_pytorch_model.bin"),
                 empty=lambda d: torch.save({}, d / "open_clip_pytorch_model.bin"),
                 pickled=lambda d: torch.save(clip.model, d / "open_clip_pytorch_model.bin"),
                 truncated=lambda d: _truncated(d, {k: v.contiguous() for k, v in sd.items()}))[case]
    folder = _snapshot(tmp_path / "snap", write)
    for name in ("quiltnet", f"open_clip:{ARCH}/{folder}"):
        with pytest.raises(ValueError, match=message) as e: load_vlm(name, folder if name == "quiltnet" else None)
        assert "\n" not in str(e.value)


def _tokenizer_loader(backend):
    from proton.models.flair import load_flair_tokenizer
    from proton.models.unimed import load_bert_tokenizer
    return dict(flair=load_flair_tokenizer, unimed=load_bert_tokenizer)[backend]


@pytest.mark.parametrize("content,problem", [(b"", r"lacks \[PAD\], \[UNK\], \[CLS\], \[SEP\]"), (b"a\nb\nfundus\n", r"lacks \[PAD\], \[UNK\]"),
                                             (b"[UNK]\n[CLS]\n[SEP]\na\n", r"lacks \[PAD\],"), (b"[PAD]\n[CLS]\n[SEP]\na\n", r"lacks \[UNK\],"),
                                             ("[PAD]\n[UNK]\n[CLS]\n[SEP]\ncaf\xe9\n".encode("latin-1"), "is not UTF-8"),
                                             (bytes(range(256)) * 20, "is not UTF-8")])
@pytest.mark.parametrize("backend", ["flair", "unimed"])
def test_an_empty_or_corrupt_vocabulary_is_named_when_it_is_read(backend, content, problem, tmp_path):
    "An empty vocab.txt, or one without [UNK], was accepted and failed at the first prompt with a bare 'WordPiece error: Missing [UNK] token'; non-UTF-8 with a bare Exception."
    (tmp_path / "vocab.txt").write_bytes(content)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'vocab.txt'))} {problem}") as e: _tokenizer_loader(backend)(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("backend", ["flair", "unimed"])
def test_a_vocabulary_file_of_another_name_is_refused_not_swapped_for_the_vocab_txt_beside_it(backend, tmp_path):
    "Given bio_clinical_vocab.txt, FLAIR's tokenizer read the vocab.txt in the same folder: another vocabulary, silently."
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nnormal\n")
    (tmp_path / "bio_clinical_vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nglaucoma\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path / 'bio_clinical_vocab.txt'))} is not named vocab.txt"):
        _tokenizer_loader(backend)(tmp_path / "bio_clinical_vocab.txt")
    assert _tokenizer_loader(backend)(tmp_path / "vocab.txt").convert_ids_to_tokens(4) == "normal"


def _unimed_checkpoint(path, vlm, edit=lambda sd: sd):
    "Save `vlm`'s weights as the authors' training code does: wrapped, with a DistributedDataParallel prefix."
    sd = edit({"module." + k: v for k, v in vlm.model.state_dict().items()})
    torch.save({"epoch": 1, "name": "unimed", "state_dict": sd}, path)
    return path


def test_unimed_round_trip(vocab, tmp_path):
    source = load_unimed("none", tokenizer=vocab, config=SMALL, seed=3)
    loaded = load_vlm("unimed-clip", checkpoint=_unimed_checkpoint(tmp_path / "u.pt", source), tokenizer=vocab, config=SMALL)
    assert isinstance(loaded, UniMedVLM) and loaded.dim == 32 and loaded.image_size == (32, 32)
    images, prompts = [skdata.camera(), skdata.chelsea()], ["a normal chest x-ray", "x"]
    E, T = loaded.encode_images(images), loaded.encode_text(prompts)
    torch.testing.assert_close(E, source.encode_images(images)); torch.testing.assert_close(T, source.encode_text(prompts))
    torch.testing.assert_close(E.norm(dim=1), torch.ones(2)); torch.testing.assert_close(T.norm(dim=1), torch.ones(2))


def test_unimed_reports_missing_and_extra_keys_by_name(vocab, tmp_path):
    source = load_unimed("none", tokenizer=vocab, config=SMALL)
    def drop(sd): return {k: v for k, v in sd.items() if k != "module.visual.ln_post.bias"}
    def add(sd): return {**sd, "module.text_encoder.transformer.pooler.dense.weight": torch.zeros(48, 48)}
    with pytest.raises(ValueError, match=r"missing keys \['visual.ln_post.bias'\]"):
        load_unimed(_unimed_checkpoint(tmp_path / "a.pt", source, drop), tokenizer=vocab, config=SMALL)
    with pytest.raises(ValueError, match=r"unexpected keys \['text_encoder.transformer.pooler.dense.weight'\]"):
        load_unimed(_unimed_checkpoint(tmp_path / "b.pt", source, add), tokenizer=vocab, config=SMALL)


def test_unimed_old_position_ids_buffer(vocab, tmp_path):
    source = load_unimed("none", tokenizer=vocab, config=SMALL)
    key = "module.text_encoder.transformer.embeddings.position_ids"
    good = _unimed_checkpoint(tmp_path / "old.pt", source, lambda sd: {**sd, key: torch.arange(64)[None]})
    load_unimed(good, tokenizer=vocab, config=SMALL)
    bad = _unimed_checkpoint(tmp_path / "bad.pt", source, lambda sd: {**sd, key: torch.arange(64).flip(0)[None]})
    with pytest.raises(ValueError, match="position_ids"): load_unimed(bad, tokenizer=vocab, config=SMALL)


def test_unimed_needs_its_files(vocab):
    with pytest.raises(ValueError, match="pass tokenizer="): load_unimed("none", config=SMALL)
    with pytest.raises(ValueError, match="pass checkpoint="): load_vlm("unimed", tokenizer=vocab, config=SMALL)


@pytest.mark.parametrize("name,help", [("quiltnet", "pass a folder holding its snapshot as checkpoint= (--checkpoint)"),
                                       ("open_clip:ViT-B-32/openai", "pass its weights file, as open_clip:ViT-B-32/<file>")])
def test_hub_weights_neither_cached_nor_reachable_are_named_at_once(monkeypatch, capfd, name, help):
    "Without internet, weights missing from the Hugging Face cache give one line that says what to pass, not a minute of retries and a RuntimeError."
    import time
    import huggingface_hub
    import proton.models.vlm as vlm_module
    if isinstance(huggingface_hub.try_to_load_from_cache("wisdomik/QuiltNet-B-32", "open_clip_config.json"), str): pytest.skip("QuiltNet is cached here")
    monkeypatch.setattr(vlm_module, "_reachable", lambda host, timeout=3.: False)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=rf"the weights of {name} are not in the Hugging Face cache and the hub is unreachable: .*{re.escape(help)}"):
        load_vlm(name)
    assert time.perf_counter() - start < 15
    assert "Retry" not in capfd.readouterr().err


def test_random_unimed_weights_are_asked_for_as_its_own_error_advises(vocab):
    "load_unimed says 'pass checkpoint= ... or 'none' for random weights', which check_vlm (so load_vlm and the command line) refused as a missing path."
    from proton.models import check_vlm
    assert check_vlm("unimed-clip", "none", tokenizer=vocab) == "unimed-clip"
    assert isinstance(load_vlm("unimed", "none", tokenizer=vocab, config=SMALL), UniMedVLM)


CHECKED = {  # what check_vlm passed and the loader then refused: (args, kwargs) given tmp_path, and the error
    "a mistyped open_clip tag": (lambda t: (("open_clip:ViT-B-32/laion2b_typo",), {}), ValueError, "unknown pretrained tag 'laion2b_typo' for open_clip's ViT-B-32"),
    "an open_clip weights path with nothing there": (lambda t: (("open_clip:ViT-S-32/none/x",), {}), FileNotFoundError, "no checkpoint file or folder at none/x"),
    "unimed-clip without a checkpoint": (lambda t: (("unimed-clip",), dict(tokenizer=t / "ok")), ValueError, r"pass checkpoint= \(--checkpoint\) the UniMed-CLIP weights"),
    "unimed-clip without a tokenizer": (lambda t: (("unimed-clip", "none"), {}), ValueError, "UniMed-CLIP needs the BiomedBERT vocabulary"),
    "unimed-clip with a folder without vocab.txt": (lambda t: (("unimed-clip", "none"), dict(tokenizer=t)), FileNotFoundError, "no vocab.txt in"),
    "unimed-clip with an empty vocab.txt": (lambda t: (("unimed-clip", t / "w.pt"), dict(tokenizer=t / "empty")), ValueError, r"empty/vocab.txt lacks \[PAD\]"),
    "flair with a folder without vocab.txt": (lambda t: (("flair", t / "w.pt"), dict(tokenizer=t / "nope")), FileNotFoundError, "no vocab.txt in"),
    "flair with a corrupt vocab.txt": (lambda t: (("flair", t / "w.pt"), dict(tokenizer=t / "corrupt")), ValueError, "corrupt/vocab.txt is not UTF-8"),
    "flair with a folder as its weights file": (lambda t: (("flair", t), dict(tokenizer=t / "ok")), IsADirectoryError, "is a folder, not a weights file"),
    "quiltnet with a file": (lambda t: (("quiltnet", t / "w.pt"), {}), ValueError, "quiltnet checkpoint must be a folder"),
    "quiltnet with a folder that is no snapshot": (lambda t: (("quiltnet", t / "ok"), {}), FileNotFoundError, "without open_clip_config.json")}


@pytest.mark.parametrize("case", CHECKED)
def test_check_vlm_names_what_the_loader_would_refuse(case, tmp_path):
    "reproduce() runs check_vlm for every domain so that none extracts before a later one fails to load; these passed it and failed at load."
    from proton.models import check_vlm
    (tmp_path / "w.pt").write_bytes(b"")
    for name, content in (("ok", b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n"), ("empty", b""), ("corrupt", bytes(range(256)))):
        (tmp_path / name).mkdir(); (tmp_path / name / "vocab.txt").write_bytes(content)
    given, error, message = CHECKED[case]
    args, kwargs = given(tmp_path)
    with pytest.raises(error, match=message) as e: check_vlm(*args, **kwargs)
    assert "\n" not in str(e.value)


def test_a_cuda_device_beyond_the_machines_is_named_before_anything_loads(monkeypatch):
    "cuda:3 on a one-GPU machine failed deep in the model's .to() with 'invalid device ordinal'."
    from proton.models import model_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"'cuda:3' was asked for, but this machine has 1 CUDA device \(cuda:0\)"): model_device("cuda:3")
    assert model_device("cuda:0") == torch.device("cuda:0") and model_device("cuda") == torch.device("cuda")


@pytest.mark.parametrize("name", ["open_clip:NoArch/none", "open_clip:vit-b-32/none"])
def test_an_unknown_open_clip_architecture_is_named_in_one_short_line_before_anything_loads(name):
    "open_clip's own error lists every architecture it knows: several kilobytes on one line."
    from proton.models import check_vlm
    with pytest.raises(ValueError, match=f"unknown open_clip architecture {name[10:-5]!r}") as e: check_vlm(name)
    assert len(str(e.value)) < 300 and "ViT-B-32" in str(e.value)
    with pytest.raises(ValueError, match="unknown open_clip architecture"): load_vlm(name)


def test_random_weights_and_a_checkpoint_together_are_refused(tmp_path):
    "open_clip:<arch>/none asks for random weights; a checkpoint as well was loaded quietly, under a name that says none."
    from proton.models import check_vlm
    (tmp_path / "w.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"asks for random weights \('none'\)"): check_vlm("open_clip:ViT-S-32/none", tmp_path / "w.pt")


@pytest.fixture(scope="module")
def backends(clip, vocab):
    "Each backend's random weights, and how a file of them is loaded."
    from proton.models.flair import random_flair
    return {"open_clip": (clip.model.state_dict(), lambda p: load_vlm(f"open_clip:{ARCH}", checkpoint=p)),
            "flair": (random_flair(0).state_dict(), lambda p: load_vlm("flair", p, tokenizer=vocab)),
            "unimed": (load_unimed("none", tokenizer=vocab, config=SMALL).model.state_dict(), lambda p: load_unimed(p, tokenizer=vocab, config=SMALL))}


@pytest.mark.parametrize("backend", ["open_clip", "flair", "unimed"])
def test_a_logit_scale_out_of_range_is_clamped_or_named_with_its_checkpoint(backend, backends, tmp_path):
    "logit_scale 800 raised OverflowError and -800 ZeroDivisionError (math.exp before the clamp); inf was refused without naming the file."
    state, load = backends[backend]
    for value, problem in ((800., None), (-800., "-800 gives no usable temperature"), (math.inf, "logit_scale must be finite, got inf")):
        path = tmp_path / f"{value}.pt"
        torch.save({**state, "logit_scale": torch.full_like(state["logit_scale"], value)}, path)
        if problem is None:
            assert load(path).temperature == 0.01  # clamped at s = 100, as for any scale above log(100)
            continue
        with pytest.raises(ValueError, match=re.escape(problem)) as e: load(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_quiltnet_advice_leads_to_a_way_that_loads_not_round_in_a_loop(tmp_path):
    "A folder without open_clip_config.json said 'pass the weights file instead', and that file was then refused: quiltnet needs a folder."
    from proton.models import check_vlm
    (tmp_path / "w.pt").write_bytes(b"")
    for given, error in ((tmp_path, FileNotFoundError), (tmp_path / "w.pt", ValueError)):
        with pytest.raises(error, match=re.escape("for a bare weights file use 'open_clip:ViT-B-32/<file>'")) as e: check_vlm("quiltnet", given)
        assert "weights file instead" not in str(e.value)
    assert check_vlm(f"open_clip:ViT-B-32/{tmp_path / 'w.pt'}") == "open_clip:ViT-B-32/" + str(tmp_path / "w.pt")


@pytest.mark.parametrize("device", ["mps", "xpu", "meta", "mps:0", torch.device("meta")])
def test_a_device_torch_knows_but_cannot_use_here_is_named_before_anything_loads(device, monkeypatch):
    "mps, xpu and meta passed model_device and failed seconds later, after the model loaded, with raw errors ('PyTorch is not linked with support for mps devices')."
    from proton.models import model_device
    import functools
    monkeypatch.setattr(torch.backends.mps, "is_available", functools.cache(lambda: False))  # cached, as torch's own: torch._dynamo reads its __wrapped__
    with pytest.raises(ValueError, match=f"the device {str(device)!r} is not available here") as e: load_vlm(f"open_clip:{ARCH}/none", device=device)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(torch.backends.mps, "is_available", functools.cache(lambda: True))
    if torch.device(device).type == "mps": assert model_device(device) == torch.device(device)
    assert model_device("cpu") == torch.device("cpu")


def test_distinct_prompts_a_small_random_model_embeds_nearly_alike_are_not_refused(tmp_path):
    """A tiny random UniMed text tower embeds 'normal' and 'glaucoma' in one prompt at 1 - cos ~ 6e-7 although their tokens differ
    inside its context: they were refused as 'read the same to the tokenizer'. The same tokens (text past the context) still are."""
    from proton.models import prompt_ensemble
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["normal", "glaucoma", "a", "photo", "of", "fundus", "the", "eye", "with"]
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *letters, *("##" + c for c in letters)]) + "\n")
    u = load_unimed("none", tokenizer=tmp_path, config=SMALL)
    prompt = lambda c, more="": [f"a fundus photo of the eye with {c}{more}"]
    ids = [u.tokenizer(prompt(c, " and many more words"), truncation=True, max_length=SMALL.context_length)["input_ids"] for c in ("normal", "glaucoma")]
    assert ids[0] != ids[1], "the case this test is about: distinct tokens inside the context"
    T = prompt_ensemble(u, {c: prompt(c, " and many more words") for c in ("normal", "glaucoma")}).double()
    assert 0 < 1 - float(torch.nn.functional.cosine_similarity(T[0], T[1], dim=0)) < 1e-5, "and nearly one direction"
    past = " with many more words after it to push the class name out"  # the name beyond 16 tokens: one text embedding
    with pytest.raises(ValueError, match=r"the classes 'normal' and 'glaucoma' have text embeddings that point the same way \(1 - cos = "):
        prompt_ensemble(u, {c: ["a fundus photo of the eye" + past + f" {c}"] for c in ("normal", "glaucoma")})
