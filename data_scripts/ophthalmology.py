"""Prepare the ophthalmology benchmark of the paper, built as Ju et al. (2025) build it.

  id         FIVES normal (N) 150 and diabetic retinopathy (D) 150
  semantic   FIVES glaucoma (G) 150 and age-related macular degeneration (A) 150
  covariate  DeepDRiD ultra-wide-field fundus images 150
  far        Imagenette validation images 150
  fit        FIVES normal 50 and diabetic retinopathy 50: the rest of each class, never a test image

Prompt sets L1 and L5 are Ju et al.'s hierarchical prompts, read from two of their notebooks (pinned by commit
and SHA-256 in the manifest).

Example:  python data_scripts/ophthalmology.py --out data/ophthalmology
Sources, sizes and licences: data_scripts/manifest.json; everything downloads without a login.
"""
import sys

if __name__ == "__main__":  # Ctrl-C while the imports below load (torch takes seconds): one line, not a traceback
    import startup
    startup.guard()

from archives import View, open_container
from common import Benchmark, command, imagenette_draw, imagenette_view, main
from splits import Draw

FIVES_CODES = {"N": "normal", "D": "diabetic_retinopathy", "G": "glaucoma", "A": "amd"}


def fives_name(key: str) -> str:
    """``train/Original/12_N.png`` -> ``train_12_N.png``: train and test both number their images from 1."""
    split, _, name = key.split("/")
    return f"{split}_{name}"


def fives_view(paths: dict) -> View:
    """FIVES colour fundus photographs: ``{train,test}/Original/<id>_<A|D|G|N>.png`` (vessel masks are ignored)."""
    return View(open_container(paths["fives"]), r"(?:train|test)/Original/\d+_[ADGN]\.png", rename=fives_name)


def fives_pick(code: str):
    """Candidates of one FIVES disease code, labelled with its folder name."""
    return lambda view: {k: FIVES_CODES[code] for k in view.keys if k.endswith(f"_{code}.png")}


def uwf_name(key: str) -> str:
    """Prefix the patient folder when a file name lacks it (``121/l3.jpg`` -> ``121_l3.jpg``)."""
    patient, name = key.split("/")[-2:]
    return name if name.startswith(f"{patient}_") else f"{patient}_{name}"


def uwf_view(paths: dict) -> View:
    """DeepDRiD ultra-wide-field images: ``ultra-widefield_images/<part>/Images/<patient>/<image>.jpg``."""
    return View(open_container(paths["deepdrid"]), r"ultra-widefield_images/[^/]+/Images/[^/]+/[^/]+\.jpg",
                rename=uwf_name)


def uwf_pick(view: View) -> dict[str, str]:
    """All 256 ultra-wide-field images (training, validation and challenge evaluation parts)."""
    return {k: "uwf" for k in view.keys}


BENCHMARK = Benchmark(
    name="ophthalmology",
    classes=("normal", "diabetic_retinopathy"),
    class_names=("normal", "diabetic retinopathy"),
    prompt_template="A fundus photograph of {}.",
    views={"fives": (("fives",), fives_view), "deepdrid_uwf": (("deepdrid",), uwf_view),
           "imagenette": (("imagenette",), imagenette_view)},
    draws=(
        Draw("fives", "id", ("normal",), 150, fives_pick("N")),
        Draw("fives", "id", ("diabetic_retinopathy",), 150, fives_pick("D")),
        Draw("fives", "semantic", ("glaucoma",), 150, fives_pick("G")),
        Draw("fives", "semantic", ("amd",), 150, fives_pick("A")),
        Draw("deepdrid_uwf", "covariate", ("uwf",), 150, uwf_pick),
        imagenette_draw(150),
        Draw("fives", "fit", ("normal",), 50, fives_pick("N")),
        Draw("fives", "fit", ("diabetic_retinopathy",), 50, fives_pick("D")),
    ),
    prompt_sources={"L1": "ju_prompts_ophthalmology_l1", "L5": "ju_prompts_ophthalmology_l5"},
    prompt_classes={"N/": "normal", "D/": "diabetic_retinopathy"},
    resize_like="flair",  # the paper's ophthalmology model
)

if __name__ == "__main__":
    sys.exit(command(lambda: main(BENCHMARK, description=__doc__)))
