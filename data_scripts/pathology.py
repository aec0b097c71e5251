"""Prepare the pathology benchmark: benign vs malignant H&E patches, PCam-derived as in the paper.

  id         PatchCamelyon test patches: no tumour in the centre ('benign') 150, metastatic tumour
             ('malignant') 150, 96x96 px lymph-node sections, written as PNG
  covariate  CRC-VAL-HE-7K normal colon mucosa (NORM) 150 and colorectal adenocarcinoma epithelium
             (TUM) 150: the same benign/malignant question in another organ, lab, scanner and size
  semantic   CRC-VAL-HE-7K tissue that is neither: adipose (ADI), debris (DEB), mucus (MUC),
             smooth muscle (MUS) and cancer-associated stroma (STR), 60 each
  far        Imagenette validation images 300
  fit        PatchCamelyon test patches: benign 150 and malignant 150 more, never a test image

No prompt sets: Ju et al.'s pathology prompts describe LC25000 lung tissue (lung_n, lung_aca), not PCam's
benign/malignant lymph-node patches.

Everything downloads from Zenodo and S3 without a login.  Reading PCam's HDF5 files needs h5py
(`pip install h5py`).

Example:  python data_scripts/pathology.py --out data/pathology
"""
import sys
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while the imports below load (torch takes seconds): one line, not a traceback
    import startup
    startup.guard()

from archives import LayoutError, View, gunzip_once, open_container, png_bytes, safe_name
from common import Benchmark, command, imagenette_draw, imagenette_view, main
from splits import Draw

PCAM_LABELS = {0: "benign", 1: "malignant"}
CRC_SEMANTIC = ("ADI", "DEB", "MUC", "MUS", "STR")


def pcam_dataset(path, # a PCam HDF5 file, gzipped or not
                 name: str, # the dataset it must hold: x or y
                 ):
    """Dataset ``name`` of a PCam file (decompressed once beside it), or a ``LayoutError`` naming the file."""
    try:
        import h5py
    except ImportError as err:
        raise ImportError("reading PatchCamelyon's HDF5 files needs h5py: pip install h5py") from err
    plain = gunzip_once(path)
    try:
        f = h5py.File(plain, "r")
    except OSError as err:
        if plain != Path(path):
            plain.unlink()  # decompressed from a bad download: the next one is decompressed afresh
        raise LayoutError(f"{path} is not an HDF5 file ({err}); delete it and download it again") from err
    if name not in f:
        raise LayoutError(f"{path} has no dataset {name!r} (it has {sorted(f)}): is it PCam's test_{name} file? "
                          "Check --local pcam_test_x and pcam_test_y")
    return f[name]


class PcamView:
    """PatchCamelyon test split as a view: key ``test/<index>`` -> the patch as PNG, label from ``y``."""

    def __init__(self, x_path, # camelyonpatch_level_2_split_test_x.h5(.gz)
                 y_path, # camelyonpatch_level_2_split_test_y.h5(.gz)
                 ):
        self.x = pcam_dataset(x_path, "x")
        y = pcam_dataset(y_path, "y")[:].reshape(-1)
        if self.x.shape[1:] != (96, 96, 3) or len(y) != self.x.shape[0]:
            raise LayoutError(f"PCam: x has shape {self.x.shape} and y {len(y)} labels; expected (N, 96, 96, 3) and N")
        self.labels = {f"test/{i:05d}": PCAM_LABELS[int(v)] for i, v in enumerate(y)}
        self.members = dict.fromkeys(self.labels)

    @property
    def keys(self) -> list[str]:
        return sorted(self.labels)

    def output_name(self, key: str) -> str:
        return safe_name(f"pcam_test_{key.split('/')[1]}.png")

    def read_many(self, keys):
        for key in sorted(keys):
            yield key, png_bytes(self.x[int(key.split("/")[1])])


def pcam_view(paths: dict) -> PcamView:
    return PcamView(paths["pcam_test_x"], paths["pcam_test_y"])


def pcam_pick(label: str):
    """Candidates of one PCam label."""
    return lambda view: {k: v for k, v in view.labels.items() if v == label}


def crc_view(paths: dict) -> View:
    """CRC-VAL-HE-7K tiles: ``<CLASS>/<CLASS>-<id>.tif`` for the nine tissue classes."""
    return View(open_container(paths["crc_val"]), r"(?:ADI|BACK|DEB|LYM|MUC|MUS|NORM|STR|TUM)/[^/]+\.tif")


def crc_pick(tissue: str):
    """Candidates of one CRC tissue class, labelled with the class code in lower case."""
    return lambda view: {k: tissue.lower() for k in view.keys if k.split("/")[0] == tissue}


BENCHMARK = Benchmark(
    name="pathology",
    classes=("benign", "malignant"),
    class_names=("benign", "malignant"),
    prompt_template="An H&E image of {} tissue.",
    views={"pcam": (("pcam_test_x", "pcam_test_y"), pcam_view), "crc_val": (("crc_val",), crc_view),
           "imagenette": (("imagenette",), imagenette_view)},
    draws=(
        Draw("pcam", "id", ("benign",), 150, pcam_pick("benign")),
        Draw("pcam", "id", ("malignant",), 150, pcam_pick("malignant")),
        Draw("crc_val", "covariate", ("norm",), 150, crc_pick("NORM")),
        Draw("crc_val", "covariate", ("tum",), 150, crc_pick("TUM")),
        *(Draw("crc_val", "semantic", (t.lower(),), 60, crc_pick(t)) for t in CRC_SEMANTIC),
        imagenette_draw(300),
        Draw("pcam", "fit", ("benign",), 150, pcam_pick("benign")),
        Draw("pcam", "fit", ("malignant",), 150, pcam_pick("malignant")),
    ),
    ood_to_id={"norm": "benign", "tum": "malignant"},
    prompt_note="Ju et al.'s pathology prompts describe LC25000 lung tissue (lung_n, lung_aca), not PCam's "
                "benign/malignant lymph-node patches, so none is fetched; classes.json's prompts are the only ones",
)

if __name__ == "__main__":
    sys.exit(command(lambda: main(BENCHMARK, description=__doc__)))
