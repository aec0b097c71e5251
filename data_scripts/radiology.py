"""Prepare the radiology benchmark: normal vs pneumonia chest X-rays from the RSNA Pneumonia Detection Challenge.

  id         RSNA 'Normal' 150 and 'Lung Opacity' (pneumonia) 150, DICOM converted to PNG
  semantic   RSNA 'No Lung Opacity / Not Normal' 300: abnormal radiographs that are neither class,
             from the same hospitals and scanners, so only the label shifts
  covariate  chest CT slices of the same two classes (Kaggle 'COVID-19 & Normal & Pneumonia CT'),
             150 normal and 150 pneumonia, as Ju et al. (2025) use CT for covariate shift
  far        Imagenette validation images 300
  fit        RSNA 'Normal' 150 and 'Lung Opacity' 150 more, never a test image

Prompt sets L1 and L10 are Ju et al.'s hierarchical chest X-ray prompts, read from two of their notebooks (pinned
by commit and SHA-256 in the manifest).

Both medical sources are on Kaggle and need a free account (RSNA also needs its competition rules
accepted once); the script prints exactly what to do when they are missing.  DICOM decoding needs
pydicom (`pip install pydicom`).

Example:  python data_scripts/radiology.py --out data/radiology
"""
import csv
import io
import re
import sys

if __name__ == "__main__":  # Ctrl-C while the imports below load (torch takes seconds): one line, not a traceback
    import startup
    startup.guard()

from archives import LayoutError, View, open_container, png_bytes
from common import Benchmark, command, imagenette_draw, imagenette_view, main
from splits import Draw

RSNA_CLASSES = {"Normal": "normal", "Lung Opacity": "pneumonia",
                "No Lung Opacity / Not Normal": "no_lung_opacity_not_normal"}


def dicom_to_png(data: bytes, # a DICOM file's bytes
                 what: str = "the file", # names it in errors
                 ) -> bytes:
    """Decode a radiograph stored as DICOM and encode it as an 8-bit PNG, converted as `proton-ood score` reads the file."""
    try:
        import pydicom
    except ImportError as err:
        raise ImportError("reading RSNA's DICOM files needs pydicom: pip install pydicom") from err
    from proton.models.vlm import dicom_to_8_bits

    try:
        return png_bytes(dicom_to_8_bits(pydicom.dcmread(io.BytesIO(data))))
    except Exception as err:  # whatever bad bytes make pydicom raise: InvalidDicomError, ValueError, AttributeError...
        raise LayoutError(f"{what} is not a readable DICOM radiograph ({err}); it starts with {data[:40]!r}") from err


def rsna_view(paths: dict) -> View:
    """RSNA stage-2 training radiographs: ``stage_2_train_images/<patientId>.dcm``, written as ``<patientId>.png``."""
    return View(open_container(paths["rsna"]), r"stage_2_train_images/[^/]+\.dcm",
                rename=lambda key: key.rsplit("/", 1)[-1][:-4] + ".png",
                convert=lambda key, data: dicom_to_png(data, f"rsna:{key}"))


def rsna_labels(view: View) -> dict[str, str]:
    """``stage_2_detailed_class_info.csv`` as image key -> label folder (one class per patient; box rows repeat it)."""
    labels = {}
    table = csv.DictReader(io.StringIO(view.find(r"stage_2_detailed_class_info\.csv").decode("utf-8-sig")))
    if not {"patientId", "class"} <= set(table.fieldnames or ()):
        raise LayoutError(f"stage_2_detailed_class_info.csv: columns {table.fieldnames}, expected patientId and class")
    for row in table:
        label = RSNA_CLASSES.get(row["class"])
        if label is None:
            raise LayoutError(f"stage_2_detailed_class_info.csv: unknown class {row['class']!r}")
        key = f"stage_2_train_images/{row['patientId']}.dcm"
        if labels.setdefault(key, label) != label:
            raise LayoutError(f"stage_2_detailed_class_info.csv gives {row['patientId']} two classes")
    return labels


def rsna_pick(label: str):
    """Candidates of one RSNA class that have an image in the archive."""
    def pick(view: View) -> dict[str, str]:
        return {k: v for k, v in rsna_labels(view).items() if v == label and k in view.members}
    return pick


def ct_view(paths: dict) -> View:
    """Chest CT slices under folders named ``normal_CT`` / ``pneumonia_CT`` (case ignored; COVID slices unused)."""
    return View(open_container(paths["chest_ct"]), r"(?:normal|pneumonia)_ct/(?:.*/)?[^/]+\.(?:png|jpe?g)",
                flags=re.IGNORECASE)


def ct_pick(label: str):
    """Candidates of one CT class folder (``normal_ct`` or ``pneumonia_ct``)."""
    return lambda view: {k: label for k in view.keys if k.split("/")[0].lower() == label}


BENCHMARK = Benchmark(
    name="radiology",
    classes=("normal", "pneumonia"),
    class_names=("normal", "pneumonia"),
    prompt_template="A chest X-ray showing {}.",
    views={"rsna": (("rsna",), rsna_view), "chest_ct": (("chest_ct",), ct_view),
           "imagenette": (("imagenette",), imagenette_view)},
    draws=(
        Draw("rsna", "id", ("normal",), 150, rsna_pick("normal")),
        Draw("rsna", "id", ("pneumonia",), 150, rsna_pick("pneumonia")),
        Draw("rsna", "semantic", ("no_lung_opacity_not_normal",), 300, rsna_pick("no_lung_opacity_not_normal")),
        Draw("chest_ct", "covariate", ("normal_ct",), 150, ct_pick("normal_ct")),
        Draw("chest_ct", "covariate", ("pneumonia_ct",), 150, ct_pick("pneumonia_ct")),
        imagenette_draw(300),
        Draw("rsna", "fit", ("normal",), 150, rsna_pick("normal")),
        Draw("rsna", "fit", ("pneumonia",), 150, rsna_pick("pneumonia")),
    ),
    ood_to_id={"normal_ct": "normal", "pneumonia_ct": "pneumonia"},
    prompt_sources={"L1": "ju_prompts_radiology_l1", "L10": "ju_prompts_radiology_l10"},
    prompt_classes={"normal/": "normal", "N": "normal", "pneumonia/": "pneumonia", "P": "pneumonia"},
)

if __name__ == "__main__":
    sys.exit(command(lambda: main(BENCHMARK, description=__doc__)))
