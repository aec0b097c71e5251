"""Inference as the authors run it: FLAIR's text pooling over the padded batch, UniMed-CLIP's ftfy text cleaning, and
extraction in float32 unless autocast is asked for (recorded in the metadata and the run fingerprint). All offline, random weights."""
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("open_clip")
from PIL import Image
from skimage import data as skdata

from proton.models import load_vlm
from proton.models.extract import _at_precision, _parser, extract
from proton.models.flair import (FLAIR, FLAIR_TEMPLATE, FLAIR_TEXT_POOLINGS, REPRODUCTION_TEXT_POOLING, FlairText, flair_prompt_ensemble,
                                 load_flair, load_flair_tokenizer, random_flair)
from proton.models.unimed import UniMedConfig, clean_prompt, load_unimed

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_vocab(folder, tokens):
    Path(folder, "vocab.txt").write_text("\n".join(SPECIAL + list(dict.fromkeys(tokens))) + "\n")
    return Path(folder)


# --- FLAIR: text pooling ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flair_tok(tmp_path_factory):
    return load_flair_tokenizer(write_vocab(tmp_path_factory.mktemp("flair_vocab"), "a fundus photograph of normal diabetic retinopathy".split()))


@pytest.fixture(scope="module")
def flair_net():
    return random_flair(seed=0)


@pytest.fixture(scope="module")
def poolings(flair_net, flair_tok):
    return {p: FLAIR(flair_net, flair_tok, text_pooling=p) for p in FLAIR_TEXT_POOLINGS}


def test_reproduction_pooling_is_upstreams():
    assert REPRODUCTION_TEXT_POOLING == "padded_batch" and REPRODUCTION_TEXT_POOLING in FLAIR_TEXT_POOLINGS


def test_padded_batch_without_padding_is_real_tokens_exactly(poolings):
    prompt = [FLAIR_TEMPLATE.format("diabetic retinopathy")]
    with torch.inference_mode():
        real, padded = (poolings[p]._text_features(prompt) for p in ("real_tokens", "padded_batch"))
    assert torch.equal(real, padded)


def test_padded_batch_moves_only_the_padded_prompts(poolings, flair_tok):
    prompts = [FLAIR_TEMPLATE.format(c) for c in ("normal", "diabetic retinopathy")]  # Ju et al.'s batch; "normal" is padded
    assert flair_tok(prompts, padding=True, return_tensors="pt")["attention_mask"].eq(0).sum(1).tolist() == [1, 0]
    with torch.inference_mode():
        real, padded = (poolings[p]._text_features(prompts) for p in ("real_tokens", "padded_batch"))
        alone = poolings["real_tokens"]._text_features(prompts[:1])
    assert not torch.allclose(real[0], padded[0], atol=1e-4)
    assert torch.equal(real[1], padded[1])
    torch.testing.assert_close(real[0], alone[0], atol=1e-5, rtol=1e-5)  # real tokens: independent of the batch


def test_padded_batch_is_upstreams_plain_mean(flair_net, flair_tok, poolings):
    prompts = [FLAIR_TEMPLATE.format(c) for c in ("normal", "diabetic retinopathy")]
    tokens = flair_tok(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.inference_mode():
        out = flair_net.text_model.model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], output_hidden_states=True)
        hidden = out.hidden_states
        layers = torch.stack([hidden[1], hidden[2], hidden[-1]]).permute(1, 0, 2, 3)  # (C, 3, T, 768), as upstream stacks them
        upstream = flair_net.text_model.projection_head_text(layers.mean(2).mean(1))
        ours = poolings["padded_batch"]._text_features(prompts)
    torch.testing.assert_close(ours, upstream, atol=1e-5, rtol=1e-5)


def test_unknown_pooling_is_refused(flair_net, flair_tok):
    with pytest.raises(ValueError, match=r"^text_pooling must be one of \('real_tokens', 'padded_batch'\), got 'mean'$"):
        FLAIR(flair_net, flair_tok, text_pooling="mean")
    with pytest.raises(ValueError, match="text_pooling must be one of"):
        FlairText.forward(flair_net.text_model, torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), "cls")
    with pytest.raises(ValueError, match="text_pooling must be one of"):  # before the checkpoint is even looked for
        load_flair("no/such/flair_resnet.pth", tokenizer=flair_tok, text_pooling="padded")


def test_load_vlm_passes_the_pooling_on(flair_net, flair_tok):
    vlm = load_vlm("flair", flair_net.state_dict(), tokenizer=flair_tok, text_pooling=REPRODUCTION_TEXT_POOLING)
    assert vlm.text_pooling == "padded_batch" and "text_pooling='padded_batch'" in repr(vlm)


def test_flair_prompt_ensemble_is_upstreams(poolings):
    padded = poolings["padded_batch"]
    ensemble = {"normal": [FLAIR_TEMPLATE.format("normal")],
                "diabetic retinopathy": [FLAIR_TEMPLATE.format("diabetic retinopathy"), FLAIR_TEMPLATE.format("normal")]}
    E = flair_prompt_ensemble(padded, ensemble)
    own_batch = padded.encode_text(ensemble["diabetic retinopathy"])  # the class's prompts, one padded batch
    torch.testing.assert_close(E[1], own_batch.mean(0))  # unit embeddings averaged, not renormalised
    assert E[1].norm() < 1 - 1e-3
    torch.testing.assert_close(E[0], padded.encode_text(ensemble["normal"])[0])
    with pytest.raises(ValueError, match="non-empty list of prompts"):
        flair_prompt_ensemble(padded, {"normal": "A fundus photograph of normal"})


# --- UniMed-CLIP: ftfy before tokenising ------------------------------------------------------------------------------

SMALL = UniMedConfig(embed_dim=32, image_size=32, patch_size=16, vision_width=64, vision_layers=2, vision_heads=2, vocab_size=200,
                     text_width=48, text_layers=2, text_heads=2, text_intermediate=96, max_positions=64, context_length=16)


@pytest.fixture(scope="module")
def unimed(tmp_path_factory):
    vocab = write_vocab(tmp_path_factory.mktemp("bert_vocab"), "a chest x ray of the patient ' s lung".split())
    return load_unimed("none", tokenizer=vocab, config=SMALL)


def test_ftfy_is_importable():
    import ftfy
    assert ftfy.fix_text("patient’s") == "patient's"


@pytest.mark.parametrize("typed", ["the patient’s chest x ray", "the patientâ€™s chest x ray", "the  patient&#x27;s\tchest x ray "])
def test_unimed_cleans_like_upstream(unimed, typed):
    straight = "the patient's chest x ray"
    assert clean_prompt(typed) == straight
    ids = lambda p: unimed.tokenizer([clean_prompt(p)]).input_ids
    assert ids(typed) == ids(straight)
    assert torch.equal(unimed.encode_text([typed]), unimed.encode_text([straight]))


def test_uncleaned_curly_apostrophe_is_another_token(unimed):
    assert unimed.tokenizer(["the patient’s"]).input_ids != unimed.tokenizer(["the patient's"]).input_ids


# --- extraction: float32 by default, autocast on request ------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    images = {"id/normal/retina.png": skdata.retina(), "id/normal/coffee.png": skdata.coffee(),
              "id/diabetic_retinopathy/microaneurysms.png": skdata.microaneurysms(), "id/diabetic_retinopathy/chelsea.png": skdata.chelsea()}
    for rel, a in images.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        im = Image.fromarray(np.ascontiguousarray(a))
        im.thumbnail((96, 96))
        im.save(path)
    return root


@pytest.fixture(scope="module")
def vit():
    return load_vlm("open_clip:ViT-S-32/none")


RUN = dict(batch_size=2, shard_size=2, num_workers=0, progress=False)


def test_float32_is_the_default_and_recorded(vit, folder):
    cache = extract(vit, folder, **RUN)
    assert cache.metadata["amp"] == "none"
    expected = vit.encode_images([Image.open(folder / f) for f in cache.source])  # CPU: the model's own float32 path
    assert np.abs(cache.image_embeddings - expected.numpy()).max() < 1e-6


def test_autocast_on_request_is_recorded_and_rounds(vit, folder):
    fp32, amp = extract(vit, folder, **RUN), extract(vit, folder, amp=True, **RUN)
    assert amp.metadata["amp"] == "float16 autocast"
    diff = np.abs(amp.image_embeddings - fp32.image_embeddings).max()
    assert 0 < diff < 1e-2


def test_at_precision_overrides_an_enclosing_autocast(vit):
    x = torch.stack([vit.preprocess(skdata.astronaut()), vit.preprocess(skdata.camera())])
    fp32 = vit.encode_images(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller's autocast does not reach the encoders: they follow `amp`
        assert torch.equal(vit.encode_images(x), fp32)
        assert torch.equal(_at_precision(vit, False).encode_images(x), fp32)
    assert not torch.equal(_at_precision(vit, True).encode_images(x), fp32)
    assert _at_precision(vit, False).model is vit.model  # the weights are shared, not copied


def test_autocast_shards_are_not_reused_by_a_float32_run(vit, folder, tmp_path):
    out = tmp_path / "cache.npz"
    extract(vit, folder, out=out, amp=True, keep_shards=True, **RUN)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp32 = extract(vit, folder, out=out, keep_shards=True, **RUN)
    stale = [str(w.message) for w in caught if "belongs to another run" in str(w.message)]
    assert len(stale) == 2  # both shards recomputed
    assert fp32.metadata["amp"] == "none"
    assert fp32.image_embeddings.tobytes() == extract(vit, folder, **RUN).image_embeddings.tobytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the float32 shards are now reused silently
        extract(vit, folder, out=out, **RUN)


def test_cli_amp_flag():
    base = ["--model", "m", "--data", "d", "--out", "o"]
    assert _parser().parse_args(base).amp is False and _parser().parse_args(base + ["--amp"]).amp is True
