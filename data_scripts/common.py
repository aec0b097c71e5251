"""What a benchmark is, how its prepared folder is made from its draws, and the command line every data script shares.

Each benchmark script (``ophthalmology.py``, ``radiology.py``, ``pathology.py``) only describes its sources and draws.
The prepared folder's layout comes from ``proton.bench.prepared``, which extraction reads it with. Besides that
contract, only the standard library is imported at module level: ``pooch``, ``requests``, ``tqdm`` and ``PIL`` (the
``data`` extra) are imported where they are used, so ``--help`` and ``--dry-run`` need the package but not the extra.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import startup
from archives import LayoutError, View, check_image, open_container
from fetching import MANIFEST, LoginRequired, fetch, kaggle_command, load_manifest, provenance, unchecked, verification
from proton.cli import _watch_ctrl_c
from proton.bench.prepared import (FIT, FOLDERS, PROMPT_SETS_FILE, _places, check_claimable, claim_folder,
                                   image_path, lock_folder, write_classes_file, write_prompt_sets, write_split_table)
from prompts import prompt_sets
from splits import SPLITS, Draw, fixed_rows, rank, read_split, select, write_split


@dataclass(frozen=True)
class Benchmark:
    """What a benchmark needs: its ID classes and prompts, its sources, its draws and its prompt sets."""
    name: str
    classes: tuple[str, ...]  # ID class folders under <out>/id/, in label order
    class_names: tuple[str, ...]  # what a prompt says for each class
    prompt_template: str  # a domain template with one {} for the class name
    views: dict  # view name -> (manifest keys, opener(paths: dict[key, Path]) -> View)
    draws: tuple[Draw, ...]  # test draws first, then the fit draws, which exclude every image a test draw took
    ood_to_id: dict = field(default_factory=dict)  # covariate label -> the ID class it shows
    prompt_sources: dict = field(default_factory=dict)  # prompt set name -> manifest key of the notebook that holds it
    prompt_classes: dict = field(default_factory=dict)  # the notebooks' class keys -> our class folders
    prompt_note: str = ""  # why there are no prompt sets, for the dry run
    resize_like: str = "clip"  # whose resize --resize repeats: "clip" (short side, PIL bicubic) or "flair" (long side, FLAIR's filter)

    def check(self) -> None:
        """Raise ``ValueError`` if the description is inconsistent."""
        if len(self.classes) != len(self.class_names):
            raise ValueError(f"{self.name}: {len(self.classes)} classes but {len(self.class_names)} class names")
        for before, d in zip((None,) + self.draws, self.draws):
            if d.shift not in FOLDERS:
                raise ValueError(f"{self.name}: unknown shift {d.shift!r}")
            if d.view not in self.views:
                raise ValueError(f"{self.name}: draw uses unknown view {d.view!r}")
            if d.shift in ("id", FIT) and not set(d.labels) <= set(self.classes):
                raise ValueError(f"{self.name}: {d.shift} draw labels {d.labels} are not classes {self.classes}")
            if before is not None and before.shift == FIT and d.shift != FIT:
                raise ValueError(f"{self.name}: the {d.shift} draw {d.scope} follows a fit draw; fit draws come last")
        if self.resize_like not in RESIZED_AS:
            raise ValueError(f"{self.name}: resize_like {self.resize_like!r} is none of {sorted(RESIZED_AS)}")
        if self.prompt_sources and sorted(set(self.prompt_classes.values())) != sorted(self.classes):
            raise ValueError(f"{self.name}: prompt_classes maps to {sorted(set(self.prompt_classes.values()))}, "
                             f"not to the classes {list(self.classes)}")

    def keys(self) -> list[str]:
        """Manifest keys this benchmark downloads: its image sources, then its prompt files."""
        return [k for view in self.views.values() for k in view[0]] + list(self.prompt_sources.values())


def prepare(bench: Benchmark, # what to prepare
            views: dict[str, View], # view name -> opened source
            out: Path, # the prepared folder
            split: Path, # split file: read, and extended with newly sampled draws unless `limit` is set
            seed: int = 0, # sampling seed for draws the split file does not fix
            limit: int | None = None, # at most this many images per draw (smoke tests; the split file is left alone)
            progressbar: bool = True, # show tqdm bars
            sources: dict | None = None, # manifest key -> how the file was verified and its SHA-256, for classes.json
            prompts: dict | None = None, # prompt set name -> class folder -> prompts, for prompt_sets.json
            resize: int | None = None, # store larger images at this size, as the benchmark's model resizes them (`resized`); None: byte for byte
            locked: bool = False, # the caller holds ``out``'s lock already (``lock_folder``)
            ) -> list[dict]:
    """Select every draw's images, write them under ``out`` with split.csv, classes.json and any prompt sets; return the split.csv rows."""
    from tqdm.auto import tqdm

    bench.check()
    shipped = read_split(split, bench.draws)
    chosen, new, taken = [], [], {}
    for draw in bench.draws:
        before = taken.setdefault(draw.view, set())  # keys of this view earlier draws chose: a fit image is never a test image
        rows, sampled = select(draw, views[draw.view], shipped, seed, limit, before)
        if not sampled and limit is None and len(rows) != draw.n:
            print(f"warning: {split} fixes {len(rows)} images of the draw {draw.scope}, not the paper's {draw.n}", file=sys.stderr)
        if sampled and limit is not None:  # the full draw's images too, as in the full run (unless the source is too small for it)
            ranked = rank(set(draw.pick(views[draw.view])) - before, seed, draw.scope)
            before.update(ranked[:draw.n] if len(ranked) >= draw.n else ())
        before.update(r.original for r in fixed_rows(draw, shipped) + rows)
        chosen += [(draw, r) for r in rows]
        if sampled:
            new += rows
    targets, source_of = {}, {}  # (view, key) -> file in the folder; file -> "view:key", to name a clash before writing
    for _, r in chosen:
        target = targets[r.source, r.original] = image_path(r.shift, r.label, views[r.source].output_name(r.original))
        if target in source_of:
            raise LayoutError(f"{source_of[target]} and {r.source}:{r.original} would both be written to {target}")
        source_of[target] = f"{r.source}:{r.original}"
    with claim_folder(out, bench.name, locked) as folder:  # written beside `out`, in its place only once complete
        table = []
        for view_name in dict.fromkeys(d.view for d, _ in chosen):
            view = views[view_name]
            wanted = {r.original: r for d, r in chosen if r.source == view_name}
            for key, data in tqdm(view.read_many(wanted), total=len(wanted), desc=f"{bench.name}: {view_name}",
                                  disable=not progressbar):
                row = wanted[key]
                check_image(data, f"{view_name}:{key}")
                if resize is not None:
                    data = resized(data, resize, f"{view_name}:{key}", bench.resize_like)
                target = targets[view_name, key]
                (folder / target).parent.mkdir(parents=True, exist_ok=True)
                (folder / target).write_bytes(data)
                table.append({"file": target, "shift": row.shift, "label": row.label, "source": view_name})
        table = write_split_table(folder, table)
        write_classes(bench, folder, table, seed, sources or {}, resize)
        if prompts:
            write_prompt_sets(folder, prompts)
        if new and limit is None:
            write_split(split, shipped + new)
    return table


RESIZE_JPEG_QUALITY = 95  # a resized JPEG is encoded again, at this quality; PNG and TIFF stay lossless
RESIZE_PNG_LEVEL = 0  # a resized PNG is stored without zlib compression: about 3x the bytes, decoded about twice as fast


RESIZED_AS = {"clip": "short side to N, PIL bicubic, the long side truncated as torchvision's Resize(N) computes it",
              "flair": "long side to N as FLAIR's preprocessing resizes it (torch bilinear, antialiased), in 8-bit RGB"}


def resized(data: bytes, # an image file's bytes
            n: int, # pixels on the stored image's short side ("clip") or long side ("flair")
            what: str, # names the image in errors, e.g. view:key
            like: str = "clip", # whose resize to repeat, a key of RESIZED_AS
            ) -> bytes:
    """The image shrunk as the model resizes it to ``n`` (``RESIZED_AS[like]``), in its own format; a smaller image unchanged."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = {"MPO": "JPEG"}.get(image.format, image.format)  # MPO: a JPEG with a multi-picture marker
            if (max if like == "flair" else min)(image.size) <= n:
                return data
            small = (flair_resized if like == "flair" else clip_resized)(image, n)
        out = io.BytesIO()
        small.save(out, format=fmt,
                   **{"JPEG": {"quality": RESIZE_JPEG_QUALITY}, "PNG": {"compress_level": RESIZE_PNG_LEVEL}}.get(fmt, {}))
    except (OSError, ValueError, KeyError, Image.DecompressionBombError) as err:  # KeyError: a format PIL reads but cannot write
        raise LayoutError(f"{what} could not be resized ({type(err).__name__}: {err}); "
                          "without --resize it is copied byte for byte") from err
    return out.getvalue()


def clip_resized(image, # a PIL image larger than `n` on its short side
                 n: int, # pixels on the short side
                 ):
    """``image`` as torchvision's ``Resize(n)`` (PIL bicubic) makes it, 16- or 32-bit grey in 8 bits as the model reads it."""
    from PIL import Image

    if image.mode in ("P", "1"):  # palette and 1-bit images resample only by nearest neighbour: widen them first
        image = image.convert("L" if image.mode == "1" else "RGBA" if "transparency" in image.info else "RGB")
    if image.mode.startswith("I"):  # 16- or 32-bit grey reaches the model scaled by the bit depth of its maximum, which a
        # resize can change (a small bright spot smoothed away): in 8 bits first, as the model reads the original
        from proton.models.vlm import as_rgb_image

        image = as_rgb_image(image).convert("L")
    w, h = image.size  # the long side truncated, as torchvision's Resize(N) computes it: the model resamples the stored image no further
    size = (n, int(h * n / w)) if w <= h else (int(w * n / h), n)
    if "A" in image.getbands():  # each band on its own: PIL's premultiplied resize turns transparent pixels black,
        # and the model reads the colours without the alpha (convert("RGB"))
        return Image.merge(image.mode, [band.resize(size, Image.Resampling.BICUBIC) for band in image.split()])
    return image.resize(size, Image.Resampling.BICUBIC)


def flair_resized(image, # a PIL image larger than `n` on its long side
                  n: int, # pixels on the long side
                  ):
    """``image`` as FLAIR's preprocessing resizes it to ``n`` (its content, without the padding), in 8-bit RGB: FLAIR resamples it no further."""
    from PIL import Image

    from proton.models.flair import _content_size, flair_preprocess

    h, w = _content_size(image.height, image.width, n)
    x = flair_preprocess(image, n)[:, :h, :w]
    return Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy())


def write_classes(bench: Benchmark, out: Path, table: list[dict], seed: int, sources: dict, resize: int | None = None) -> None:
    """Write ``classes.json``: ID classes in label order, prompts, counts per shift and label, and how images were resized."""
    counts: dict = {}
    for r in table:
        counts.setdefault(r["shift"], {}).setdefault(r["label"], 0)
        counts[r["shift"]][r["label"]] += 1
    write_classes_file(out, bench.classes, bench.class_names, {c: [name] for c, name in zip(bench.classes, bench.class_names)},
                       benchmark=bench.name, prompt_template=bench.prompt_template,
                       templated_prompts={c: [bench.prompt_template.format(name)] for c, name in zip(bench.classes, bench.class_names)},
                       ood_to_id=bench.ood_to_id, counts=counts, seed=seed, sources=sources,
                       prompt_set_sources=dict(bench.prompt_sources),
                       resize=resize, resized_as=None if resize is None else {
                           "resampling": RESIZED_AS[bench.resize_like],
                           "formats": f"kept; PNG and TIFF lossless, JPEG re-encoded at quality {RESIZE_JPEG_QUALITY}"})


# ---------------------------------------------------------------------------------------------- command line

def default_raw() -> Path:
    """Where downloads are kept unless --raw says otherwise: $PROTON_DATA_RAW or ~/.cache/proton-ood/raw."""
    if os.environ.get("PROTON_DATA_RAW"):
        return Path(os.environ["PROTON_DATA_RAW"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "proton-ood" / "raw"


def parser(description: str, name: str) -> argparse.ArgumentParser:
    """The command line every data script shares."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="prepared folder to write")
    p.add_argument("--raw", type=Path, default=None,
                   help=f"folder for downloads, shared by all scripts (default: {default_raw()})")
    p.add_argument("--seed", type=int, default=0, help="sampling seed for draws the split file does not fix (default 0)")
    p.add_argument("--dry-run", action="store_true", help="list what would be fetched and written; no network, no writes")
    p.add_argument("--split", type=Path, default=SPLITS / f"{name}.csv",
                   help="split file: its rows fix the images; draws it lacks are sampled and added to it")
    p.add_argument("--local", action="append", default=[], metavar="SOURCE=PATH",
                   help="use a file or extracted folder you already have for a source (repeatable)")
    p.add_argument("--manifest", type=Path, default=MANIFEST, help="manifest of sources")
    p.add_argument("--limit", type=int, default=None,
                   help="at most this many images per draw, for a quick smoke test (the split file is not changed)")
    p.add_argument("--resize", type=int, default=None, metavar="N",
                   help="store images larger than N at N as the benchmark's model resizes them (ophthalmology: the long "
                        "side, as FLAIR; the others: the short side, as the CLIP models), never enlarged, e.g. the model's "
                        "input size, in their own format (PNG lossless and uncompressed, to decode fast); default: byte for byte")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def parse_local(items: list[str], known: list[str]) -> dict[str, Path]:
    """``["key=path", ...]`` as a dict of absolute paths (what the prepared folder records), refusing unknown keys and paths that do not exist."""
    local = {}
    for item in items:
        key, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--local {item!r}: expected SOURCE=PATH")
        if key not in known:
            raise ValueError(f"--local {item!r}: unknown source {key!r}; this script's sources are {known}")
        if not Path(path).expanduser().exists():  # before any download, not when its turn comes
            raise FileNotFoundError(f"--local {key}={path}: no such file or folder")
        local[key] = Path(os.path.abspath(Path(path).expanduser()))  # a link keeps its own name: a copy named as the manifest says is checked
    return local


def check_counts(limit: int | None, resize: int | None) -> None:
    """Refuse a ``--limit`` or ``--resize`` below 1; None is 'not given', 0 is a number."""
    for name, value in (("limit", limit), ("resize", resize)):
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")


def check_file(option: str, # the option, e.g. "--split"
               path: Path | None, # its value; None: not given
               ) -> None:
    """Refuse a folder given where a file is read."""
    if path is not None and path.expanduser().is_dir():
        raise ValueError(f"{option} {path.expanduser()} is a folder, not a file")


def check_outside(option: str, # the option, e.g. "--raw"
                  path: Path, # its value
                  out: Path, # the prepared folder
                  what: str, # what must stay outside, for the message, e.g. "downloads"
                  ) -> None:
    """Refuse a path that is ``--out``, or inside it or the folders beside it that a run builds it in and clears."""
    path, out = path.resolve(), out.resolve()
    for place in (out, *_places(out)[:2]):  # beside out, or inside it when it is a mount point
        if path == place or place in path.parents:
            where = "also --out" if path == out else f"inside --out {out}" if place == out else f"inside {place}, where --out {out} is built"
            raise ValueError(f"{option} {path} is {where}; keep {what} in a folder outside it")


def plan(bench: Benchmark, manifest: dict, raw: Path, out: Path, split: Path, seed: int,
         local: dict[str, Path], limit: int | None = None, resize: int | None = None) -> str:
    """The dry-run report: every source (URL, size, licence, login, destination), every draw and the prompt sets. Touches no network."""
    lines = [f"PROTON data, {bench.name} benchmark: dry run (nothing is downloaded or written)", "", "Sources:"]
    for key in bench.keys():
        e = manifest["sources"][key]
        lines.append(f"  {key}: {e['title']}")
        lines.append(f"    size     {e['approx_size']}" + (f" ({e['size_bytes']} bytes)" if e["size_bytes"] else ""))
        lines.append(f"    licence  {e['licence']}")
        lines.append(f"    verified  {key in local and unchecked(e, local[key].expanduser()) or verification(e)}")
        dest = raw / e["filename"]
        if key in local:
            lines.append(f"    use      {local[key]} (--local)")
            continue
        if e["download"] == "http":
            lines.append(f"    from     {e['url']}  (no login)")
        else:
            lines.append(f"    from     {e['page']}  (needs a Kaggle account"
                         + (" and accepted competition rules" if e["download"] == "kaggle-competition" else "") + ")")
            lines.append(f"    command  {' '.join(kaggle_command(e, raw))}")
            lines.append("    login    a normal run without the file prints the steps (token, kaggle.json, rules)")
        part = raw / f"{e['filename']}.part"
        state = ("present" if dest.exists() else
                 f"partial, {part.stat().st_size} bytes, will resume" if part.exists() else "not downloaded yet")
        lines.append(f"    to       {dest}  [{state}]")
    rows = read_split(split, bench.draws)
    lines += ["", f"Images, written to {out}/<shift>/<label>/ (split file {split}"
              f"{'' if split.exists() else ', not there yet'}"
              f"{'' if resize is None else f'; --resize {resize}: {RESIZED_AS[bench.resize_like]}'}):"]
    for d in bench.draws:
        fixed = fixed_rows(d, rows)
        n = len(fixed) or d.n  # what the run writes
        n = n if limit is None else min(n, limit)
        how = (f"fixed by the split file ({len(fixed)} rows{'' if len(fixed) == d.n else f'; the paper draws {d.n}'})" if fixed else
               f"sampled on the first run with seed {seed}" + (", among the images no test draw took" if d.shift == FIT else "")
               + ("" if limit else ", then added to the split file"))
        folder = f"{d.shift}/{d.labels[0] if len(d.labels) == 1 else '<class>'}/"
        lines.append(f"  {n:4d}  {folder:<36} from {d.view:<12} {how}")
    if any(d.shift == FIT for d in bench.draws):
        lines += ["", "fit/ holds labelled ID images for fitting privileged detectors (kNN, Mahalanobis); none is a test image."]
    if bench.prompt_sources:
        lines += ["", f"Prompt sets, written to {out / PROMPT_SETS_FILE}:"]
        lines += [f"  {name:<4} from {key} ({manifest['sources'][key]['title']})" for name, key in bench.prompt_sources.items()]
    else:
        lines += ["", f"Prompt sets: none. {bench.prompt_note}."]
    lines += ["", f"Also written: {out / 'split.csv'} (file, shift, label, source) and {out / 'classes.json'}"]
    return "\n".join(lines)


def run(bench: Benchmark, # the benchmark to prepare
        argv: list[str] | None = None, # command-line arguments (default: sys.argv[1:])
        description: str = "", # --help text
        ) -> list[dict] | str:
    """Parse arguments and prepare a benchmark (or return the dry-run plan); raises on any problem."""
    args = parser(description, bench.name).parse_args(argv)
    # '--out=~/x' reaches us as typed: no shell expands a '~' after '='
    args.out, args.split, args.manifest = (p.expanduser() for p in (args.out, args.split, args.manifest))
    check_file("--split", args.split)
    check_file("--manifest", args.manifest)
    manifest = load_manifest(args.manifest, bench.keys())
    raw = (args.raw or default_raw()).expanduser()
    local = parse_local(args.local, bench.keys())
    check_counts(args.limit, args.resize)
    check_outside("--raw", raw, args.out, "downloads")
    check_outside("--split", args.split, args.out, "the split file")  # the rows a first run samples would go with the old --out
    if args.dry_run:
        check_claimable(args.out, bench.name)  # what the run would refuse at once
        return plan(bench, manifest, raw, args.out, args.split, args.seed, local, args.limit, args.resize)
    with lock_folder(args.out):  # held from the first download to the last write: a second run on --out stops at once
        check_claimable(args.out, bench.name)  # what would stop the writing, before hours of downloads
        read_split(args.split, bench.draws)
        paths, verified, missing = {}, {}, []
        # Kaggle sources first, so that missing credentials are reported before hours of other downloads
        for key in sorted(bench.keys(), key=lambda k: manifest["sources"][k]["download"] == "http"):
            if missing and manifest["sources"][key]["download"] == "http":
                break
            try:
                paths[key], verified[key] = fetch(key, manifest["sources"][key], raw, local.get(key), progressbar=not args.no_progress)
            except LoginRequired as err:
                missing.append(str(err))
        if missing:
            raise LoginRequired("\n\n".join(missing))
        prompts = prompt_sets(bench, paths)  # before any image is written: a bad prompt file stops the run early
        views = {name: opener(paths) for name, (_, opener) in bench.views.items()}
        sources = {key: provenance(verified[key], path) for key, path in paths.items()}
        return prepare(bench, views, args.out, args.split, seed=args.seed, limit=args.limit,
                       progressbar=not args.no_progress, sources=sources, prompts=prompts, resize=args.resize, locked=True)


def main(bench: Benchmark, argv: list[str] | None = None, description: str = "") -> int:
    """``run`` for the command line: prints the plan or a summary, turns any failure but Ctrl-C and a broken pipe into one line and an exit code."""
    try:
        result = run(bench, argv, description)
    except BrokenPipeError:  # the reader of stdout left: ``command`` ends the script
        raise
    except Exception as err:
        if CTRL_C:  # an error that Ctrl-C caused (a read it cut short, a kaggle command it ended) is the Ctrl-C: prepare_all stops
            raise KeyboardInterrupt from err
        if isinstance(err, LoginRequired):
            print(err, file=sys.stderr)
            return 2
        if isinstance(err, (ValueError, OSError, ImportError)):
            print(f"error: {err}", file=sys.stderr)
            return 1
        # one line too, so that prepare_all goes on with the other benchmarks; Ctrl-C still stops
        print(f"error: unexpected {type(err).__name__}: {err} (a bug: please report it with the command you ran)", file=sys.stderr)
        return 1
    if isinstance(result, str):
        print(result)
        return 0
    counts: dict = {}
    for r in result:
        counts[r["shift"]] = counts.get(r["shift"], 0) + 1
    print(f"{bench.name}: wrote {len(result)} images ({', '.join(f'{s} {counts[s]}' for s in FOLDERS if s in counts)})")
    return 0


CTRL_C: list = []  # an entry per Ctrl-C during a script's work, noted by `command`'s handler


def command(body: Callable[[], int], # the script's work; returns its exit code
            ) -> int:
    """``body()`` as a script's exit code: a reader of stdout that leaves ends it silently (141), Ctrl-C in one line (130)."""
    if signal.getsignal(signal.SIGINT) is startup.interrupted:  # the imports are done: Ctrl-C interrupts the work, whose cleanup runs
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _watch_ctrl_c(CTRL_C)
    try:
        code = body()
        sys.stdout.flush()  # buffered output fails here, not in Python's flush at exit
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's recipe: what is left goes nowhere
        return 141
    except KeyboardInterrupt:  # what was written is safe: a partial folder is cleared on the way out
        print(f"{Path(sys.argv[0]).name}: interrupted", file=sys.stderr)
        return 130
    finally:
        CTRL_C.clear()


# ---------------------------------------------------------------------------------------------- far OOD: Imagenette

IMAGENETTE_CLASSES = {  # WordNet ID -> folder name; the ten Imagenette classes
    "n01440764": "tench", "n02102040": "english_springer", "n02979186": "cassette_player",
    "n03000684": "chain_saw", "n03028079": "church", "n03394916": "french_horn",
    "n03417042": "garbage_truck", "n03425413": "gas_pump", "n03445777": "golf_ball", "n03888257": "parachute",
}


def imagenette_view(paths: dict) -> View:
    """The 3,925 validation images of Imagenette (``val/<wnid>/<name>.JPEG``)."""
    return View(open_container(paths["imagenette"]), r"val/n\d{8}/[^/]+\.JPEG")


def imagenette_pick(view: View) -> dict[str, str]:
    """Every Imagenette validation image, labelled with its class."""
    return {k: IMAGENETTE_CLASSES[k.split("/")[1]] for k in view.keys if k.split("/")[1] in IMAGENETTE_CLASSES}


def imagenette_draw(n: int) -> Draw:
    """Far-OOD: ``n`` Imagenette validation images, any class."""
    return Draw("imagenette", "far", tuple(IMAGENETTE_CLASSES.values()), n, imagenette_pick)
