"""FLAIR backend: upstream's checkpoint layout, strict loading, preprocessing geometry, tokenisation and encoding, all offline."""
import hashlib
import io
import math
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("torchvision")
from PIL import Image

import proton.models.flair as flair_mod
from proton.models.flair import (FLAIR, FLAIR_TEMPLATE, FLAIR_WEIGHTS_FILE, flair_preprocess, load_flair, load_flair_tokenizer,
                          random_flair)
from proton.models import load_vlm

# SHA-256 of upstream's layout: one "name [shape]" line per tensor, sorted by name, joined by newlines. Computed from the
# 520-entry list of names and shapes derived from upstream's FLAIRModel definition (not from this package).
UPSTREAM_LAYOUT_SHA256 = "06427da77fc377e36ba84a821fa25d296014b8ce94aa5fdc18deede4d95eeb4d"
WORDS = "a fundus photograph of normal glaucoma diabetic retinopathy".split()


def layout_digest(state):
    return hashlib.sha256("\n".join(f"{k} {list(v.shape)}" for k, v in sorted(state.items())).encode()).hexdigest()


def write_vocab(folder, words):
    Path(folder, "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return Path(folder)


@pytest.fixture(scope="module")
def net():
    return random_flair(seed=0)


@pytest.fixture(scope="module")
def state(net):
    return net.state_dict()


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    return write_vocab(tmp_path_factory.mktemp("vocab"), WORDS)


@pytest.fixture(scope="module")
def tok(vocab_dir):
    return load_flair_tokenizer(vocab_dir)


@pytest.fixture(scope="module")
def backend(net, tok):
    return FLAIR(net, tok)


# --- the checkpoint layout -------------------------------------------------------------------------------------------

def test_random_checkpoint_has_upstream_layout(state):
    assert len(state) == 520
    prefixes = {p: sum(k.split(".")[0] == p for k in state) for p in ("vision_model", "text_model", "logit_scale")}
    assert prefixes == {"vision_model": 319, "text_model": 200, "logit_scale": 1}
    assert layout_digest(state) == UPSTREAM_LAYOUT_SHA256
    assert state["vision_model.projection_head_vision.projection.weight"].shape == (512, 2048)
    assert state["text_model.projection_head_text.projection.weight"].shape == (512, 768)
    assert state["text_model.model.embeddings.word_embeddings.weight"].shape == (28996, 768)
    assert not any(k.endswith("projection.bias") or ".fc." in k for k in state)


def test_random_weights_are_seeded_and_leave_global_rng_alone():
    before = torch.random.get_rng_state()
    a, b = random_flair(seed=3).state_dict(), random_flair(seed=4).state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    key = "vision_model.model.conv1.weight"
    assert torch.equal(a[key], random_flair(seed=3).state_dict()[key])
    assert not torch.equal(a[key], b[key])


# --- strict loading --------------------------------------------------------------------------------------------------

def test_strict_load_from_file_round_trips(tmp_path, net, state, vocab_dir):
    path = tmp_path / FLAIR_WEIGHTS_FILE
    torch.save(state, path)
    vlm = load_vlm("flair", path, tokenizer=vocab_dir)
    assert isinstance(vlm, FLAIR) and vlm.name == "flair" and vlm.dim == 512 and vlm.image_size == (512, 512)
    loaded = vlm.net.state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert vlm.temperature == pytest.approx(0.07)


def test_missing_key_is_refused_by_name(state, tok):
    broken = {k: v for k, v in state.items() if k != "vision_model.model.layer3.1.bn2.running_var"}
    with pytest.raises(ValueError, match=r"missing keys \['vision_model.model.layer3.1.bn2.running_var'\]"):
        load_flair(broken, tokenizer=tok)


def test_wrong_shape_is_refused_by_name(state, tok):
    wrong = {**state, "vision_model.projection_head_vision.projection.weight": torch.zeros(512, 1024)}
    with pytest.raises(ValueError, match=r"vision_model.projection_head_vision.projection.weight: \(512, 1024\) vs \(512, 2048\)"):
        load_flair(wrong, tokenizer=tok)


def test_unexpected_and_non_tensor_entries_are_refused(state, tok):
    with pytest.raises(ValueError, match=r"unexpected keys \['text_model.extra'\]"):
        load_flair({**state, "text_model.extra": torch.zeros(1)}, tokenizer=tok)
    with pytest.raises(ValueError, match="not tensors: \\['epoch'\\]"):
        load_flair({**state, "epoch": 3}, tokenizer=tok)


def test_legacy_position_ids_and_state_dict_wrapper_are_accepted(tmp_path, state, tok):
    path = tmp_path / "wrapped.pth"
    torch.save({"state_dict": {**state, "text_model.model.embeddings.position_ids": torch.arange(512)[None]}}, path)
    vlm = load_flair(path, tokenizer=tok)
    key = "text_model.projection_head_text.projection.weight"
    assert torch.equal(vlm.net.state_dict()[key], state[key])


def test_a_state_dict_passed_as_a_dict_is_unwrapped_as_a_file_is(state, tok):
    "load_flair({'state_dict': sd}) was refused as 'not tensors', and a 'module.' prefix was left on every key."
    key = "text_model.projection_head_text.projection.weight"
    for wrapped in ({"state_dict": state, "epoch": 1}, {"module." + k: v for k, v in state.items()}):
        assert torch.equal(load_flair(wrapped, tokenizer=tok).net.state_dict()[key], state[key])


def test_pickled_objects_are_refused(tmp_path, tok):
    path = tmp_path / "evil.pth"
    torch.save({"logit_scale": torch.zeros(()), "payload": io.StringIO("x")}, path)
    with pytest.raises(ValueError, match="refusing to load"):
        load_flair(path, tokenizer=tok)


def test_logit_scale_is_clamped_to_100(state, tok):
    vlm = load_flair({**state, "logit_scale": torch.tensor(math.log(500.))}, tokenizer=tok)
    assert vlm.temperature == pytest.approx(0.01)


def test_a_negative_logit_scale_is_clamped_to_0_as_upstream_does(state, tok):
    "Upstream's compute_logits clamps logit_scale to [0, log 100] at inference; a negative one gave τ = e here, not 1."
    vlm = load_flair({**state, "logit_scale": torch.tensor(-1.)}, tokenizer=tok)
    assert vlm.temperature == 1.


# --- the default weights: cache, download and offline refusal --------------------------------------------------------

def test_offline_without_checkpoint_says_what_to_pass(tmp_path, monkeypatch, tok):
    monkeypatch.setattr(flair_mod, "_reachable", lambda host, timeout=3.: False)
    with pytest.raises(FileNotFoundError, match="pass checkpoint="):
        load_flair(None, tokenizer=tok, cache_dir=tmp_path)


def fake_download(payload):
    def download(url, dst, progress=True):
        assert url == flair_mod.FLAIR_WEIGHTS_URL
        Path(dst).write_bytes(payload)
    return download


def test_download_unpacks_the_archive(tmp_path, monkeypatch):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z: z.writestr(f"flair_pretrained_weights/{FLAIR_WEIGHTS_FILE}", b"weights")
    monkeypatch.setattr(flair_mod, "_reachable", lambda host, timeout=3.: True)
    monkeypatch.setattr(torch.hub, "download_url_to_file", fake_download(buffer.getvalue()))
    path = flair_mod._fetch_flair_weights(tmp_path)
    assert path == tmp_path / FLAIR_WEIGHTS_FILE and path.read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == [FLAIR_WEIGHTS_FILE]  # the archive is removed
    monkeypatch.setattr(torch.hub, "download_url_to_file", fake_download(b"<html>quota exceeded</html>"))
    assert flair_mod._fetch_flair_weights(tmp_path) == path  # cached: no second download


def test_download_that_is_not_a_zip_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(flair_mod, "_reachable", lambda host, timeout=3.: True)
    monkeypatch.setattr(torch.hub, "download_url_to_file", fake_download(b"<html>quota exceeded</html>"))
    with pytest.raises(ValueError, match="not a zip archive"):
        flair_mod._fetch_flair_weights(tmp_path)
    assert not any(tmp_path.iterdir())


# --- preprocessing ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("height, width, content", [(1024, 2048, (256, 512)), (2048, 1024, (512, 256)), (300, 300, (512, 512))])
def test_preprocessing_geometry(height, width, content):
    image = np.random.default_rng(0).integers(1, 256, size=(height, width, 3), dtype=np.uint8)
    x = flair_preprocess(image)
    h, w = content
    assert x.shape == (3, 512, 512) and x.dtype == torch.float32
    assert (x[:, :h, :w] > 0).all()
    assert (x[:, h:] == 0).all() and (x[:, :, w:] == 0).all()
    assert x.min() >= 0 and x.max() <= 1


def test_preprocessing_matches_torchvision_resize_and_pil_input():
    from torchvision.transforms import Resize
    image = np.random.default_rng(1).integers(0, 256, size=(600, 800, 3), dtype=np.uint8)
    x = flair_preprocess(image)
    assert torch.equal(flair_preprocess(Image.fromarray(image)), x)
    ref = Resize((384, 512), antialias=True)(torch.from_numpy(image.astype(np.float32) / 255).permute(2, 0, 1))
    torch.testing.assert_close(x[:, :384], ref.clamp(0, 1), atol=1e-6, rtol=0)
    assert x[:, 384:].abs().sum() == 0


def test_preprocessing_refuses_float_arrays():
    with pytest.raises(ValueError, match="must be uint8"):
        flair_preprocess(np.zeros((10, 10, 3)))


# --- tokenizer -------------------------------------------------------------------------------------------------------

def test_tokenizer_lower_cases_like_upstream(tok, vocab_dir):
    ids = tok(["A Fundus photograph of GLAUCOMA"])["input_ids"][0]
    assert tok.convert_ids_to_tokens(ids) == ["[CLS]", "a", "fundus", "photograph", "of", "glaucoma", "[SEP]"]
    assert load_flair_tokenizer(vocab_dir / "vocab.txt")(["glaucoma"])["input_ids"] == tok(["glaucoma"])["input_ids"]


def test_tokenizer_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no vocab.txt"):
        load_flair_tokenizer(tmp_path)
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(flair_mod, "_reachable", lambda host, timeout=3.: False)
    with pytest.raises(FileNotFoundError, match=r"pass tokenizer= \(--tokenizer\) a folder holding its vocab.txt"):
        load_flair_tokenizer(None)


def test_tokenizer_larger_than_the_embedding_table_is_refused(tmp_path, net):
    big = load_flair_tokenizer(write_vocab(tmp_path, [f"w{i}" for i in range(29000)]))
    with pytest.raises(ValueError, match="29005 tokens but the text encoder only 28996"):
        FLAIR(net, big)


# --- encoding --------------------------------------------------------------------------------------------------------

def test_encode_shapes_and_unit_norm(backend):
    from skimage import data
    E = backend.encode_images([data.retina(), Image.fromarray(data.coffee())], batch_size=1)
    T = backend.encode_text([FLAIR_TEMPLATE.format(c) for c in ("normal", "glaucoma", "diabetic retinopathy")])
    assert E.shape == (2, 512) and T.shape == (3, 512)
    assert E.dtype == T.dtype == torch.float32 and E.device.type == "cpu"
    torch.testing.assert_close(E.norm(dim=1), torch.ones(2))
    torch.testing.assert_close(T.norm(dim=1), torch.ones(3))
    again = backend.encode_images(torch.stack([backend.preprocess(data.retina())]))
    torch.testing.assert_close(again, E[:1], atol=1e-5, rtol=0)


def test_text_features_ignore_padding_like_unpadded_upstream(backend, tok, net):
    prompts = ["a fundus photograph of glaucoma", "normal", "a fundus photograph of diabetic retinopathy"]
    with torch.inference_mode():
        together = backend._text_features(prompts)
        for i, p in enumerate(prompts):
            t = tok([p], return_tensors="pt")
            hidden = net.text_model.model(**t, output_hidden_states=True).hidden_states
            plain = torch.stack([hidden[1], hidden[2], hidden[-1]]).mean(2).mean(0)  # upstream: mean over all tokens
            expected = net.text_model.projection_head_text(plain)
            torch.testing.assert_close(F.normalize(together[i:i + 1], dim=-1), F.normalize(expected, dim=-1), atol=1e-5, rtol=0)


def test_image_and_local_features(backend):
    batch = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        glob, local = backend._image_features(batch), backend._local_features(batch)
        single = backend._image_features(batch[1:])
    assert glob.shape == (2, 512) and local.shape == (2, 2 * 3, 512)
    torch.testing.assert_close(single, glob[1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(F.normalize(local.mean(1), dim=-1), F.normalize(glob, dim=-1), atol=1e-5, rtol=0)
    assert backend.has_local
