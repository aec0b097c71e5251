"""`proton-ood reproduce` end to end, offline: tiny prepared folders of generated images, random-weight models, the whole report."""
import json
import os
from pathlib import Path
import re
import sys
import warnings

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from skimage import data as skdata

from proton.bench.prepared import write_classes_file, write_prompt_sets, write_split_table

MODEL = "open_clip:ViT-S-32/none"  # the smallest open_clip ViT, random weights (seed 0)
SOURCES = {"id": (skdata.retina, skdata.astronaut), "semantic": (skdata.coffee,), "covariate": (skdata.chelsea,), "far": (skdata.rocket,)}
COUNTS = {"id": 6, "semantic": 8, "covariate": 8, "far": 8, "fit": 3}  # per class for id and fit, per shift otherwise


def variant(image, k:int, side:int=48):
    "The k-th small variant of a bundled image: a crop, a flip and a brightness change, so no two images are alike."
    a = np.asarray(image())
    a = a if a.ndim == 3 else np.stack([a] * 3, -1)
    h, w = a.shape[:2]
    y, x = (k * 17) % (h // 4), (k * 29) % (w // 4)
    crop = a[y:y + 3 * h // 4, x:x + 3 * w // 4, :3]
    crop = crop[:, ::-1] if k % 2 else crop
    im = Image.fromarray(np.clip(crop.astype(int) + 6 * k - 20, 0, 255).astype(np.uint8))
    im.thumbnail((side, side))
    return im


def make_domain(root, classes=("a", "b"), prompt_sets=True):
    "A prepared folder: two ID classes, three OOD shifts, a fit split, classes.json, split.csv and (optionally) prompt sets."
    rows, k = [], 0
    for shift, n in COUNTS.items():
        labels = classes if shift in ("id", "fit") else (f"{shift}_set",)
        for c, label in enumerate(labels):
            source = SOURCES["id"][c] if shift in ("id", "fit") else SOURCES[shift][0]
            for i in range(n):
                rel = f"{shift}/{label}/img_{k:03d}.png"; k += 1
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                variant(source, k).save(root / rel)
                rows.append(dict(file=rel, shift=shift, label=label, source="skimage"))
    write_split_table(root, rows)
    write_classes_file(root, classes, [f"class {c}" for c in classes], {c: [f"class {c}"] for c in classes}, benchmark=root.name)
    if prompt_sets:
        write_prompt_sets(root, {"L1": {c: [f"a photo of class {c}"] for c in classes},
                                 "L5": {c: [f"class {c}, view {j}" for j in range(5)] for c in classes}})
    return root


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    for domain in ("ophthalmology", "radiology"):  # pathology left out: the report must say so
        make_domain(root / "data" / domain, prompt_sets=domain == "ophthalmology")
    from proton.cli import main
    code = main(["reproduce", "--data", str(root / "data"), "--out", str(root / "report"), "--model", MODEL,
                 "--permutations", "1", "--no-progress", "--device", "cpu"])
    return root, code


def test_reproduce_runs_end_to_end(report):
    root, code = report
    assert code == 0
    out = root / "report"
    assert (out / "report.md").is_file() and (out / "figures" / "figure3a.png").is_file() and (out / "figures" / "figure3b.png").is_file()
    for name in ("table2", "table1a", "table1b", "table3a", "table3b", "table3c", "table4a", "table4b"):
        assert (out / "tables" / f"{name}.csv").is_file(), name


def test_tables_put_ours_beside_the_papers(report):
    out = report[0] / "report"
    t2 = pd.read_csv(out / "tables" / "table2.csv", header=[0, 1], index_col=0)
    assert ("covariate AUROC", "reported by the paper") in t2.columns and ("covariate AUROC", "ours") in t2.columns
    assert t2.loc["PROTON", ("covariate AUROC", "reported by the paper")] == 66.3
    assert t2.loc[["MCM", "MCM (L=1)", "MCM (L=5)", "PROTON"], ("covariate AUROC", "ours")].notna().all()  # prompt sets came through
    t1b = pd.read_csv(out / "tables" / "table1b.csv", header=[0, 1], index_col=0)
    assert list(t1b[("MCM", "ours")].dropna().index) == ["Ophth. (FLAIR)", "Radio. (UniMedCLIP)"]


def test_metadata_records_models_hashes_protocol_and_what_is_missing(report):
    out = report[0] / "report"
    md = json.loads((out / "metadata.json").read_text())
    assert set(md["domains"]) == {"ophthalmology", "radiology"}
    oph = md["domains"]["ophthalmology"]
    assert oph["model"] == MODEL and oph["fit_images"] == 6 and oph["prompt_sets"] == ["L1", "L5", "tag"]
    assert len(oph["cache_sha256"]) == 64 and len(oph["data"]["split.csv"]) == 64
    assert md["protocol"]["rho"] == 0.7 and md["protocol"]["fpr95_convention"] == "ju2025" and md["protocol"]["n_permutations"] == 1
    assert md["versions"]["torch"] and "domain pathology" in md["not_made"]
    assert "pathology" in (out / "report.md").read_text()


def test_a_second_run_reuses_the_caches(report, tmp_path):
    root = report[0]
    from proton.models.reproduce import domain_cache
    path, cache = domain_cache("radiology", root / "data" / "radiology", root / "report" / "caches", MODEL)
    assert path.name == "radiology_open_clip-ViT-S-32-none.npz" and len(cache) == 2 * 6 + 3 * 8


@pytest.mark.parametrize("missing", ["semantic", "covariate", "far"])
def test_a_domain_without_one_shift_gets_its_tables_with_that_shift_left_empty(missing, tmp_path):
    "A prepared folder without one shift (a source that could not be fetched) still gives its tables and figures: that shift's cells are empty, and the notes say why."
    from proton.bench import EmbeddingCache, SyntheticWorld
    from proton.models.reproduce import figure3a, figure3b, paper_results
    full = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=120, n_per_shift=40)
    cache = full.subset(np.flatnonzero(np.array(full.shift) != missing))
    tables, raw, notes = paper_results({"ophthalmology": cache, "radiology": cache}, n_permutations=1, progress=False)
    covariate_only = ("table1b", "table3b", "table3c", "table4a", "table4b")  # Table 1(b), 3(b, c) and 4 are about the covariate shift
    assert sorted(tables) == sorted({"table2", "table1a", "table1b", "table3a", "table3b", "table3c", "var_ref", "table4a", "table4b", "triage"}
                                    - ({"table3b", "table3c", "var_ref"} if missing == "covariate" else set()))  # no covariate: no sensitivity sweep
    for name, t in tables.items():
        ours = t.xs("ours", axis=1, level=1)
        empty = [c for c in ours.columns if ours[c].isna().all()]
        assert sorted(empty) == sorted(c for c in ours.columns if missing in c or (missing == "covariate" and name in covariate_only)), (name, empty)
    assert f"no '{missing}' images" in notes["table1a"]
    if missing == "covariate":  # no sweep: each table and figure of it says why, as one not made
        assert raw["sensitivity"] == {} and not any(k.startswith("sensitivity") for k in notes), notes
        for name in ("table3b", "table3c", "var_ref", "figure3b"):
            assert notes[name].startswith("could not be made: the sensitivity sweep on ophthalmology could not run: "), (name, notes[name])
        assert "radiology" in notes["figure3b"], notes["figure3b"]
    else: assert figure3b(raw["sensitivity"], tmp_path / "b.png").is_file()
    assert figure3a({"ophthalmology": cache}, tmp_path / "a.png").is_file()


def test_the_data_record_reads_a_classes_file_saved_with_a_byte_order_mark(tmp_path):
    from proton.models.reproduce import _data_hashes
    (tmp_path / "classes.json").write_bytes('\ufeff{"classes": ["a", "b"], "sources": {"rsna": "abc"}}'.encode())
    assert _data_hashes(tmp_path)["sources"] == {"rsna": "abc"}


def test_no_prepared_folder_is_one_line_error(tmp_path, capsys):
    from proton.cli import main
    assert main(["reproduce", "--data", str(tmp_path), "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("proton-ood reproduce: error: no prepared folder in") and "\n" not in err


@pytest.mark.parametrize("option,message", [("--model", "unknown VLM 'nosuch'"), ("--checkpoint", "no checkpoint file or folder at")])
def test_a_later_domain_that_cannot_load_its_model_stops_the_run_before_the_first_extracts(tmp_path, capsys, option, message):
    "Ophthalmology's extraction can take an hour: radiology's wrong model name or weights path is named before it, in one line."
    from proton.cli import main
    for domain in ("ophthalmology", "radiology"): make_domain(tmp_path / "data" / domain, prompt_sets=False)
    wrong = dict(model="radiology=nosuch", checkpoint=f"radiology={tmp_path / 'absent.pt'}")[option[2:]]
    args = ["reproduce", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "report"), "--model", MODEL, option, wrong, "--no-progress", "--device", "cpu"]
    if option == "--model": args[args.index(MODEL) - 1: args.index(MODEL) + 1] = ["--model", f"ophthalmology={MODEL}"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("proton-ood reproduce: error: radiology: ") and message in err and "\n" not in err, err
    assert not list((tmp_path / "report").rglob("*.npz")), "no cache was extracted"


def test_a_run_whose_extraction_fails_leaves_no_report_folder(tmp_path, capsys):
    "tables/ and figures/ were made once the models were checked, before extraction: a prepared folder it could not read left them behind, empty."
    from proton.cli import main
    make_domain(tmp_path / "data" / "ophthalmology", prompt_sets=False)
    (tmp_path / "data" / "ophthalmology" / "classes.json").write_text("{not json")
    assert main(["reproduce", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "report"), "--model", MODEL, "--no-progress", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("proton-ood reproduce: error: ") and "classes.json is not valid JSON" in err and "\n" not in err, err
    assert not (tmp_path / "report").exists(), sorted(p.name for p in (tmp_path / "report").rglob("*"))


@pytest.mark.parametrize("kind", ["file", "read-only folder"])
def test_a_report_folder_it_cannot_write_is_refused_before_extraction(tmp_path, capsys, kind):
    "Once tables/ and figures/ were made late, an --out that is a file (or a folder it cannot write) was found only after every cache was extracted and every experiment run."
    from proton.cli import main
    make_domain(tmp_path / "data" / "ophthalmology", prompt_sets=False)
    out = tmp_path / "report"
    if kind == "file": out.write_text("not a folder")
    else: out.mkdir(); out.chmod(0o500)
    if kind != "file" and os.access(out, os.W_OK): pytest.skip("root writes a read-only folder")
    try: code = main(["reproduce", "--data", str(tmp_path / "data"), "--out", str(out), "--caches", str(tmp_path / "caches"), "--model", MODEL, "--no-progress", "--device", "cpu"])
    finally: out.chmod(0o700) if kind != "file" else None
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("proton-ood reproduce: error: ") and str(out) in err and "\n" not in err, err
    assert not (tmp_path / "caches").exists()  # nothing extracted


def test_a_mistyped_open_clip_tag_stops_the_run_before_the_first_domain_extracts(tmp_path, capsys):
    "open_clip found the tag unknown only when radiology's turn came, after ophthalmology's extraction."
    from proton.cli import main
    for domain in ("ophthalmology", "radiology"): make_domain(tmp_path / "data" / domain, prompt_sets=False)
    assert main(["reproduce", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "report"), "--model", f"ophthalmology={MODEL}",
                 "--model", "radiology=open_clip:ViT-B-32/laion2b_typo", "--no-progress", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("proton-ood reproduce: error: radiology: unknown pretrained tag 'laion2b_typo' for open_clip's ViT-B-32") and "\n" not in err, err
    assert not list((tmp_path / "report").rglob("*.npz")), "no cache was extracted"


def test_a_cache_made_with_other_weights_or_a_missing_checkpoint_is_refused_before_anything_runs(tmp_path, capsys):
    """An existing cache is reused only with the weights it was made with: another --checkpoint is refused in one line that names
    the domain and both weights, and a checkpoint that does not exist is named, before anything is written."""
    from proton.cli import main
    from proton.models import load_vlm
    from proton.models.extract import extract
    from proton.models.reproduce import _cache_file, domain_cache
    data, caches = tmp_path / "data", tmp_path / "caches"
    make_domain(data / "ophthalmology", prompt_sets=False)
    w1, w2 = tmp_path / "w1.pt", tmp_path / "w2.pt"
    w1.write_bytes(b"the weights the cache was made with")
    w2.write_bytes(b"other weights")
    made = extract(load_vlm(MODEL), data / "ophthalmology", out=_cache_file("ophthalmology", caches, MODEL), checkpoint=w1,
                   num_workers=0, progress=False)
    assert domain_cache("ophthalmology", data / "ophthalmology", caches, MODEL, w1)[1].content_hash() == made.content_hash()
    with pytest.raises(ValueError, match="ophthalmology: the cache .* was made with the weights w1.pt"):
        domain_cache("ophthalmology", data / "ophthalmology", caches, MODEL)  # the model's own weights are not w1.pt either
    args = ["reproduce", "--data", str(data), "--caches", str(caches), "--model", MODEL, "--permutations", "1", "--no-progress", "--device", "cpu"]
    for checkpoint, messages in ((w2, ("made with the weights w1.pt", "w2.pt", "--caches")), (tmp_path / "absent.pt", ("no checkpoint file or folder at",))):
        out = tmp_path / f"report_{checkpoint.stem}"
        assert main(args + ["--out", str(out), "--checkpoint", str(checkpoint)]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("proton-ood reproduce: error: ophthalmology: ") and all(m in err for m in messages) and "\n" not in err, err
        assert not out.exists(), "nothing was written"


def test_the_report_names_the_model_behind_our_numbers(report):
    text = (report[0] / "report" / "report.md").read_text()
    for domain, paper in (("ophthalmology", "flair"), ("radiology", "unimed-clip")):  # ours from MODEL, the paper's from its own
        assert re.search(rf"{domain}: {re.escape(MODEL)}, not the paper's {paper}\b", text), text[:600]


def test_a_cache_extracted_from_other_images_under_the_same_names_is_refused(tmp_path):
    """A prepared folder made again (say at the model's input resolution) keeps its file names; the cache extracted from the old
    images must not be reused for the new ones as if nothing had changed."""
    from proton.models.reproduce import domain_cache
    data, caches = tmp_path / "ophthalmology", tmp_path / "caches"
    make_domain(data, prompt_sets=False)
    domain_cache("ophthalmology", data, caches, MODEL, device="cpu", progress=False)
    again = data / "id" / "a" / "img_000.png"
    variant(skdata.retina, 1, side=40).save(again)  # the same image at another size
    with pytest.raises(ValueError, match=r"ophthalmology_open_clip-ViT-S-32-none.npz was extracted from other images than .*ophthalmology holds now"):
        domain_cache("ophthalmology", data, caches, MODEL, device="cpu", progress=False)


def test_a_cache_of_other_pixels_in_files_of_the_same_names_and_sizes_is_refused(tmp_path):
    """--resize stores PNG files uncompressed, so a folder prepared again has the same names and byte sizes whatever its pixels:
    a fingerprint of names and sizes took the cache of the old images for the new ones."""
    from proton.models.reproduce import domain_cache
    data, caches = tmp_path / "ophthalmology", tmp_path / "caches"
    make_domain(data, prompt_sets=False)
    image = data / "id" / "a" / "img_000.png"
    variant(skdata.retina, 1).save(image, compress_level=0)
    domain_cache("ophthalmology", data, caches, MODEL, device="cpu", progress=False)
    size = image.stat().st_size
    variant(skdata.retina, 2).save(image, compress_level=0)  # other pixels, as many bytes
    assert image.stat().st_size == size
    with pytest.raises(ValueError, match=r"ophthalmology_open_clip-ViT-S-32-none.npz was extracted from other images than .*ophthalmology holds now"):
        domain_cache("ophthalmology", data, caches, MODEL, device="cpu", progress=False)


def test_a_folder_stored_below_the_models_input_is_refused(tmp_path):
    """prepare_all.py --resize 224 then reproduce fed FLAIR (512 px) upsampled images, unsaid: the paper's numbers come from
    images at the model's input or larger. Refused whether the cache is to be extracted or is already there."""
    from proton.models.reproduce import domain_cache
    data, caches = tmp_path / "ophthalmology", tmp_path / "caches"
    make_domain(data, prompt_sets=False)
    info = json.loads((data / "classes.json").read_text())
    small = lambda: (data / "classes.json").write_text(json.dumps(info | {"resize": {"short_side": 40}}))
    refused = r"^ophthalmology: the images of .*ophthalmology are stored at 40 pixels \(--resize 40\), below .* input of 224 pixels.* --resize 224"
    small()
    with pytest.raises(ValueError, match=refused):
        domain_cache("ophthalmology", data, caches, MODEL, device="cpu", progress=False)
    assert not any(caches.glob("*.npz"))
    (data / "classes.json").write_text(json.dumps(info))
    domain_cache("ophthalmology", data, caches, MODEL, device="cpu", progress=False)
    small()  # the same image files, now said to be stored small
    with pytest.raises(ValueError, match=refused):
        domain_cache("ophthalmology", data, caches, MODEL, device="cpu", progress=False)


OLD_CACHES = {  # what a cache extracted before a change records, and why reproduce will not reuse it
    # made before the images' contents were hashed: names and sizes cannot tell other pixels
    "no images_sha256": (lambda m: m.pop("images_sha256"), r"records no SHA-256 of its images' contents .* move it away to extract afresh$"),
    # ViT local features were the final-layer patch tokens until they followed GL-MCM's value path, and nothing told them apart:
    # GL-MCM's numbers silently came from the wrong features
    "local features before the value path": (lambda m: m.pop("local_features"), r"holds local features from before they followed GL-MCM's value path")}


@pytest.mark.parametrize("case", OLD_CACHES)
def test_a_cache_from_before_a_change_is_not_reused(case, tmp_path):
    from proton.models.reproduce import domain_cache
    edit, message = OLD_CACHES[case]
    data, caches = tmp_path / "ophthalmology", tmp_path / "caches"
    make_domain(data, prompt_sets=False)
    path, cache = domain_cache("ophthalmology", data, caches, MODEL, device="cpu", progress=False)
    assert cache.local_embeddings is not None and cache.metadata["local_features"] == "value path of the last block (GL-MCM)"
    edit(cache.metadata)
    cache.save(path)  # as a cache extracted before
    with pytest.raises(ValueError, match=rf"^ophthalmology: the cache .* {message}"):
        domain_cache("ophthalmology", data, caches, MODEL, device="cpu", progress=False)


def test_extraction_inside_reproduce_keeps_its_warnings_but_the_skipped_images(tmp_path):
    "domain_cache ignored every warning of extract, 'recomputing shard k' among them; only the skipped images are said elsewhere (the report)."
    from proton.models import load_vlm
    from proton.models.extract import extract
    from proton.models.reproduce import _cache_file, domain_cache
    data, caches = tmp_path / "ophthalmology", tmp_path / "caches"
    make_domain(data, prompt_sets=False)
    path = _cache_file("ophthalmology", caches, MODEL)
    extract(load_vlm(MODEL), data, out=path, shard_size=2, keep_shards=True, num_workers=0, progress=False)
    path.unlink()  # the shards of another run (another shard size) stay, as a killed run with other settings leaves them
    with pytest.warns(UserWarning, match=r"recomputing shard 0: .* belongs to another run"):
        domain_cache("ophthalmology", data, caches, MODEL, device="cpu", progress=False)


@pytest.fixture(scope="module")
def simulated_tables():
    "A simulated ophthalmology cache without a fit split, and the tables `paper_results` makes of it (one order per shift)."
    from proton.bench.cache import EmbeddingCache
    from proton.bench.synth import SyntheticWorld
    from proton.models.reproduce import paper_results
    c = EmbeddingCache.from_world(SyntheticWorld.preset("ophthalmology"), n_id=100, n_per_shift=40, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return c, paper_results({"ophthalmology": c}, n_permutations=1, progress=False)[0]


def test_one_configuration_gives_one_number_across_the_tables_on_a_cache_without_a_fit_split(simulated_tables):
    "Without a fit split, every table streams the images left after one held-out split: PROTON's and MCM's defaults agree across tables, and Table 2 is the main table's."
    from proton.bench.experiments.main_table import main_table
    c, t = simulated_tables
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main = main_table(c, n_permutations=1, progress=False)
    o = lambda name: t[name].xs("ours", axis=1, level=1)
    proton = {o("table2").loc["PROTON", "covariate AUROC"], o("table4b").loc["proton", "covariate AUROC"], o("table1a").loc[0.7, "covariate"],
              o("table1b").loc["Ophth. (FLAIR)", "PROTON"], o("table3a").loc["+ confidence gate (full)", "covariate"], o("table3b").loc[0.7, "AUROC"]}
    mcm = {o("table2").loc["MCM", "covariate AUROC"], o("table3a").loc["mcm", "covariate"], o("table1b").loc["Ophth. (FLAIR)", "MCM"]}
    assert len(proton) == 1 and len(mcm) == 1, (proton, mcm)
    cov = main[main["shift"] == "covariate"].groupby("method").auroc.mean().mul(100).round(1)
    assert proton == {cov["proton"]} and mcm == {cov["mcm"]}


@pytest.fixture(scope="module")
def flair_files(tmp_path_factory):
    "A random FLAIR checkpoint in upstream's layout and a small vocabulary: (weights file, tokenizer folder)."
    import torch
    from proton.models.flair import FLAIR_WEIGHTS_FILE, random_flair
    root = tmp_path_factory.mktemp("flair")
    torch.save(random_flair(0).state_dict(), root / FLAIR_WEIGHTS_FILE)
    (root / "vocab").mkdir()
    (root / "vocab" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "fundus", "photograph", "of", "normal"]) + "\n")
    return root / FLAIR_WEIGHTS_FILE, root / "vocab"


def test_a_flair_cache_extracted_with_another_text_pooling_is_not_reused(tmp_path, flair_files):
    """`proton-ood extract --model flair` could only pool FLAIR's prompts over their real tokens, and reproduce reused its cache
    although it promises upstream's padded_batch pooling; the cache did not record the pooling, so a cache of before cannot tell it either."""
    from proton.bench.cache import EmbeddingCache
    from proton.cli import main
    from proton.models.reproduce import _cache_file, domain_cache
    weights, vocab = flair_files
    data, caches = tmp_path / "ophthalmology", tmp_path / "caches"
    for rel in ("id/a/0.png", "id/b/0.png", "far/far_set/0.png"):  # three tiny images: FLAIR runs at 512 px on a CPU
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        variant(skdata.retina, len(rel), side=16).save(data / rel)
    write_classes_file(data, ("a", "b"), ("a", "b"), {"a": ["normal"], "b": ["a fundus photograph of normal"]}, benchmark="ophthalmology")
    out = _cache_file("ophthalmology", caches, "flair")
    cmd = ["extract", "--model", "flair", "--checkpoint", str(weights), "--tokenizer", str(vocab), "--data", str(data), "--out", str(out),
           "--no-prompt-sets", "--workers", "0", "--device", "cpu", "--no-progress", "--keep-shards"]
    reuse = lambda: domain_cache("ophthalmology", data, caches, "flair", weights, vocab, "cpu", progress=False)
    assert main(cmd) == 0
    real = EmbeddingCache.load(out)
    assert real.metadata["text_pooling"] == "real_tokens"
    with pytest.raises(ValueError, match=r"^ophthalmology: the cache .* pools FLAIR's prompts as real_tokens, but the reproduction pools them as padded_batch: "
                                         r"extract it again with --text-pooling padded_batch"):
        reuse()
    assert main(cmd + ["--text-pooling", "padded_batch"]) == 0
    made = out.stat().st_mtime_ns
    cache = reuse()[1]
    assert out.stat().st_mtime_ns == made and cache.metadata["text_pooling"] == "padded_batch"
    assert not np.allclose(cache.text_embeddings[0], real.text_embeddings[0], atol=1e-3)  # the short prompt pools otherwise: the option reached the model
    del cache.metadata["text_pooling"]
    cache.save(out)  # as a cache written before the pooling was recorded
    with pytest.raises(ValueError, match=r"^ophthalmology: the cache .* records no text pooling \(made before it was recorded\), but the reproduction"):
        reuse()


PAPER_TEX = Path(os.environ.get("PROTON_PAPER_TEX", "/work/shared/paper/proton-paper.tex"))  # the paper's LaTeX source, where this machine has it
PARTS = {"tab:main": ("zero-shot OOD detection",), "tab:robust": ("ID fraction ρ", "in each domain"),  # each table of the paper: its parts, by a phrase of the report's caption
         "tab:ablations": ("components are added", "confidence threshold γ", "bank size M"), "tab:basescores": ("six base scores", "broader baselines")}


def paper_table_numbers(tex:str):
    "{label: number} of the paper's tables: LaTeX numbers them in the order of their captions."
    tables = re.findall(r"\\begin\{table\*?\}(.*?)\\end\{table\*?\}", tex, flags=re.S)
    return {re.search(r"\\label\{([^}]*)\}", t).group(1): n for n, t in enumerate((t for t in tables if "\\caption" in t), 1)}


@pytest.mark.skipif(not PAPER_TEX.is_file(), reason=f"no paper source at {PAPER_TEX} (set PROTON_PAPER_TEX)")
def test_each_table_of_the_report_carries_the_papers_table_number():
    "The report's table names, captions and `REPORTED` keys number each table as LaTeX numbers it in the paper's source."
    from proton.bench.experiments import REPORTED
    from proton.models.reproduce import CAPTIONS
    numbers = paper_table_numbers(PAPER_TEX.read_text())
    assert set(numbers) == set(PARTS)
    for label, phrases in PARTS.items():
        for part, phrase in zip("abc" if len(phrases) > 1 else ("",), phrases):
            [name] = [k for k, c in CAPTIONS.items() if phrase in c]
            assert name == f"table{numbers[label]}{part}" and name in REPORTED, (label, phrase, name)
            assert CAPTIONS[name].startswith(f"Table {numbers[label]}" + (f"({part})" if part else "") + ":"), CAPTIONS[name]


def test_figure3a_draws_the_drift_and_dashes_the_index_where_every_class_reaches_k_min(tmp_path, monkeypatch):
    "The paper's Figure 3(a): cosine to the final prototype, drift and PCA paths per domain, dashed lines where all classes reach K_min."
    import matplotlib.pyplot as plt
    from proton.bench import EmbeddingCache, SyntheticWorld
    from proton.bench.experiments.dynamics import dynamics
    from proton.detector import ProtonConfig
    from proton.models.reproduce import figure3a
    cache = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=120, n_per_shift=40)
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)  # keep the figure instead of closing it
    figure3a({"ophthalmology": cache, "radiology": cache}, tmp_path / "a.png")
    [fig] = drawn
    rows = dynamics(cache, shifts="covariate")
    at = rows.groupby("t").received.min().ge(ProtonConfig().k_min).idxmax()  # the first index at which every class holds K_min images
    assert len(fig.axes) == 2 * 3
    for cosine, drift, paths in np.reshape(fig.axes, (2, 3)):
        assert "cosine" in cosine.get_ylabel() and "drift" in drift.get_ylabel() and "PC 2" in paths.get_ylabel()
        dashed = lambda ax: {float(l.get_xdata()[0]) for l in ax.lines if l.get_linestyle() == "--" and len(set(l.get_xdata())) == 1}
        assert dashed(cosine) == {at} and dashed(drift) == {ProtonConfig().k_min}
        assert len(drift.lines) > 1  # the classes' drift curves beside the dashed line


def test_the_main_table_has_the_papers_delta_row_and_the_rho_table_its_mcm_reference(simulated_tables):
    "Table 2's 'Δ vs MCM' row is PROTON's row less MCM's, ours and the paper's; Table 1(a)'s 'MCM (ref.)' row is MCM at ρ = 0.7 beside the paper's MCM."
    from proton.bench.experiments import PAPER
    main, rho = simulated_tables[1]["table2"], simulated_tables[1]["table1a"]
    assert np.allclose(main.loc["Δ vs MCM"], main.loc["PROTON"] - main.loc["MCM"], atol=1e-9)
    assert main.loc["Δ vs MCM", ("covariate AUROC", PAPER)] == 23.9 and main.loc["Δ vs MCM", ("semantic FPR95", PAPER)] == -11.1
    assert rho.loc["MCM (ref.)", ("covariate", PAPER)] == 42.4
    assert rho.loc["MCM (ref.)", ("covariate", "ours")] == main.loc["MCM", ("covariate AUROC", "ours")]


def test_the_report_names_what_of_the_paper_it_does_not_make(report):
    "Figure 1 and the robustness numbers of the paper's text are not in the report: its metadata and the command's output say so."
    md = json.loads((report[0] / "report" / "metadata.json").read_text())
    assert "figure1" in md["not_made"] and "misrouting and stream orders" in md["not_made"]
    assert "Figure 1" in (report[0] / "report" / "report.md").read_text()


def test_a_source_date_epoch_out_of_range_is_a_one_line_error_naming_it(tmp_path, capsys, monkeypatch):
    "reproduce printed 'error: OverflowError: timestamp out of range for platform time_t', naming neither the variable nor the problem."
    from proton.cli import main
    make_domain(tmp_path / "data" / "radiology", prompt_sets=False)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "99999999999999999999")
    assert main(["reproduce", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "r"), "--model", MODEL, "--no-progress", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("proton-ood reproduce: error: ") and "SOURCE_DATE_EPOCH=99999999999999999999 is out of range" in err and "\n" not in err, err


def test_a_second_run_into_the_same_out_moves_the_first_runs_report_aside(report, tmp_path):
    "A second run into the same --out (one domain gone) left the first run's tables and figures beside a report.md and metadata.json that called them not made."
    import shutil
    from proton.cli import main
    root = report[0]
    shutil.copytree(root / "report", tmp_path / "report")
    shutil.copytree(root / "data" / "radiology", tmp_path / "data" / "radiology")  # ophthalmology's folder has gone missing
    first = {p.relative_to(tmp_path / "report").as_posix(): p.read_bytes() for p in (tmp_path / "report").rglob("*") if p.is_file() and "caches" not in p.parts}
    assert main(["reproduce", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "report"), "--model", MODEL,
                 "--permutations", "1", "--no-progress", "--device", "cpu"]) == 0
    out, earlier = tmp_path / "report", tmp_path / "report" / "earlier_runs" / "1"
    assert {k: (earlier / k).read_bytes() for k in first} == first  # the first run's report, tables and figures, whole
    assert not (out / "tables" / "table2.csv").exists() and (out / "tables" / "table1b.csv").is_file()
    md = json.loads((out / "metadata.json").read_text())
    assert md["earlier_run"] == "earlier_runs/1" and "table2" in md["not_made"] and list(md["domains"]) == ["radiology"]
    assert "earlier_runs/1" in (out / "report.md").read_text()


def test_the_sigma_sweep_and_the_triage_stand_beside_the_papers(simulated_tables):
    "The paper's σ²₀ range of mean AUROC and its triage macro-F1 were neither reproduced nor named as left out."
    from proton.bench.experiments import PAPER
    from proton.models.reproduce import CAPTIONS
    t = simulated_tables[1]
    v = t["var_ref"]
    assert v.loc["lowest", ("mean AUROC", PAPER)] == 69.8 and v.loc["highest", ("mean AUROC", PAPER)] == 71.2
    assert 0 < v.loc["lowest", ("mean AUROC", "ours")] <= v.loc["highest", ("mean AUROC", "ours")] <= 100
    tri = t["triage"]
    assert set(tri.index) == {"logistic", "tree"} and (tri[("macro-F1", PAPER)] == 70.0).all()
    assert tri[("macro-F1", "ours")].between(0, 100).all()
    assert "var_ref" in CAPTIONS and "triage" in CAPTIONS


def test_table4a_has_the_papers_delta_column(simulated_tables):
    "Table 4(a) lacked the paper's Δ column (+19.7 … +23.9)."
    from proton.bench.experiments import PAPER
    a = simulated_tables[1]["table4a"]
    assert a.loc["max_logit", ("Δ", PAPER)] == 19.7 and a.loc["mcm", ("Δ", PAPER)] == 23.9
    ours = a.xs("ours", axis=1, level=1)
    assert np.allclose(ours["Δ"], (ours["+PROTON"] - ours["base"]).round(1), equal_nan=True)


def test_every_number_of_the_tables_has_one_decimal(report, simulated_tables):
    "Table 1(b)'s Δ was written as 26.099999999999994: every cell is rounded to one decimal, as the paper writes them."
    frames = list(simulated_tables[1].values())
    frames += [pd.read_csv(p, header=[0, 1], index_col=0) for p in sorted((report[0] / "report" / "tables").glob("*.csv"))]
    for t in frames:
        values = t.to_numpy(dtype=float)
        ok = np.isnan(values) | (values == np.round(values, 1))
        assert ok.all(), t[~ok.all(axis=1)]


def test_earlier_runs_are_set_aside_under_the_next_free_number(tmp_path):
    "A third run into one folder must keep both earlier reports, each whole, under earlier_runs/1 and earlier_runs/2."
    from proton.models.reproduce import _set_aside
    assert _set_aside(tmp_path) is None  # nothing to move
    for run in ("first", "second"):
        (tmp_path / "tables").mkdir(); (tmp_path / "tables" / "table2.csv").write_text(run); (tmp_path / "report.md").write_text(run)
        (tmp_path / "cache.npz").write_text("kept")
        moved = _set_aside(tmp_path)
        assert (tmp_path / moved / "report.md").read_text() == run and (tmp_path / moved / "tables" / "table2.csv").read_text() == run
    assert moved == "earlier_runs/2" and (tmp_path / "earlier_runs" / "1" / "report.md").read_text() == "first"
    assert (tmp_path / "cache.npz").read_text() == "kept" and not (tmp_path / "report.md").exists()


def test_the_command_says_where_the_earlier_report_went(tmp_path, monkeypatch, capsys):
    "The final line named the tables not made but not the folder an earlier report was moved to."
    import proton.models.reproduce as rp
    def fake(data, out, *rest):
        (Path(out) / "metadata.json").write_text(json.dumps(dict(made=["table2"], not_made=[], earlier_run="earlier_runs/1")))
        return Path(out) / "report.md"
    monkeypatch.setattr(rp, "reproduce", fake)
    assert rp.reproduce_main(["--data", str(tmp_path), "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"; the earlier report moved to {tmp_path / 'earlier_runs' / '1'}")


def test_the_sigma_range_averages_the_shifts_before_it_rounds():
    "The σ²₀ range averaged per-shift AUROCs already rounded to 0.1: 70.149, 70.149 and 70.249 gave 70.1, not 70.2."
    from proton.models.reproduce import var_ref_range
    rows = [dict(sweep="var_ref", method="proton", var_ref=0.02, shift=s, auroc=a, aupr_out=.5, fpr95=.5)
            for s, a in zip(("semantic", "covariate", "far"), (.70149, .70149, .70249))]
    t = var_ref_range(pd.DataFrame(rows))
    assert t.iloc[0, 0] == t.iloc[1, 0] == 70.2, t
