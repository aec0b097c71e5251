"""The course's structure: every chapter is in the table of contents, installs itself in Colab only, ends with a summary and exercises,
cites the works it names with MyST roles (which link to the references page), and marks optional deep dives one way."""
import json
import re
import unicodedata
from pathlib import Path

import pytest
from toc import TOC_FILES

ROOT = Path(__file__).parents[1]


CHAPTERS = [f for f in TOC_FILES if f not in ("nbs/index",) and not f.endswith("references")]


def cells(name):
    return json.loads((ROOT / f"{name}.ipynb").read_text())["cells"]


def test_toc_and_notebooks_agree():
    listed = set(TOC_FILES)
    assert all((ROOT / f"{f}.ipynb").exists() for f in listed), [f for f in listed if not (ROOT / f"{f}.ipynb").exists()]
    orphans = [p.stem for p in (ROOT / "nbs").glob("*.ipynb") if f"nbs/{p.stem}" not in listed and not p.stem.startswith("_")]
    assert not orphans, f"notebooks missing from _toc.yml: {orphans}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_installs_itself_only_in_colab(chapter):
    code = ["".join(c["source"]) for c in cells(chapter) if c["cell_type"] == "code"]
    colab = [c for c in code if "google.colab" in c]
    assert colab, f"{chapter} has no Colab set-up cell"
    cell = colab[0]
    assert cell.lstrip().startswith("#| hide"), f"{chapter}: the Colab cell must be hidden in the book"
    assert re.search(r'if "google.colab" in sys.modules:\n(\s+.*\n?)*\s+%pip install -q "proton-ood\[course', cell), f"{chapter}: install only under Colab, with the course extra"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_ends_with_summary_and_exercises(chapter):
    headings = [line for c in cells(chapter) if c["cell_type"] == "markdown" for line in "".join(c["source"]).splitlines() if line.startswith("## ")]
    assert "## Summary" in headings and "## Exercises" in headings, f"{chapter}: missing Summary or Exercises"
    assert headings.index("## Summary") < headings.index("## Exercises")


# --- citations: an author-year reference in the prose is a MyST citation, which links to the references page ---

NOTEBOOKS = sorted(f"nbs/{p.stem}" for p in (ROOT / "nbs").glob("*.ipynb"))


def fold(text):
    "`text` without accents, so that 'Rodriguez' and 'Rodríguez' compare equal."
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))


def bib_first_authors(bibtex):
    "(key, first author's surname, year) of every entry of a BibTeX text that has an author and a year."
    out = []
    for m in re.finditer(r"^@\w+\{([^,\s]+),(.*?)^\}", bibtex, re.S | re.M):
        author, year = re.search(r"\bauthor\s*=\s*\{(.*?)\},?\s*$", m[2], re.S | re.M), re.search(r"\byear\s*=\s*\{?(\d{4})", m[2])
        if not (author and year): continue
        first = re.sub(r"\\[`'\"^~=.]\{?(\w)\}?", r"\1", author[1].split(" and ")[0])  # LaTeX accents: {\'i} -> {i}
        surname = first.split(",")[0] if "," in first else first.split()[-1]
        out.append((m[1], fold(surname.replace("{", "").replace("}", "").strip()), year[1]))
    return out


ENTRIES = bib_first_authors((ROOT / "nbs" / "references.bib").read_text())
KEYS_OF = {}
for key, surname, year in ENTRIES: KEYS_OF.setdefault((surname, year), []).append(key)
SURNAMES = "|".join(sorted({re.escape(s) for _, s, _ in ENTRIES}, key=len, reverse=True))
OTHER = r"[A-Z][\w'-]+"
PLAIN_CITATION = re.compile(  # Ju et al. (2025), (Miyai et al., IJCV 2025), Liu & Zach, ECCV 2024, Welford (1962), Chan, Golub and LeVeque (1983)
    rf"\b(?P<surname>{SURNAMES})"
    rf"(?:\s+et\s+al\.?|\s+(?:and|&)\s+{OTHER}|(?:,\s+{OTHER})+,?\s+(?:and|&)\s+{OTHER})?"  # co-authors
    rf",?\s*(?:\*[^*\n]{{1,200}}\*\s*)?"  # an italic title
    rf"[(\[]?\s*(?:[A-Za-z][\w&/.-]*,?\s+){{0,4}}"  # a venue of up to four words
    rf"(?P<year>(?:19|20)\d\d)\b")
NAME_ONLY = re.compile(rf"\b(?P<surname>{SURNAMES})\s+et\s+al\b")
CITE_ROLE = re.compile(r"\{cite(?::\w+)?\}`([^`]*)`")
NOT_PROSE = re.compile(r"```.*?```|`[^`\n]*`|\]\([^)\s]*\)", re.S)  # code, roles' contents, link targets


def prose(markdown):
    "The markdown with code spans, role contents and link targets blanked out, accents removed, line breaks kept."
    return NOT_PROSE.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), fold(markdown))


def plain_citations(markdown):
    "(line, text, keys) of every plain-text author-year citation in `markdown` of a work that has a key in the bibliography."
    text = prose(markdown)
    return [(text.count("\n", 0, m.start()) + 1, m[0], KEYS_OF[m["surname"], m["year"]])
            for m in PLAIN_CITATION.finditer(text) if (m["surname"], m["year"]) in KEYS_OF]


def markdown_cells(name):
    return [(i, "".join(c["source"])) for i, c in enumerate(cells(name)) if c["cell_type"] == "markdown"]


def test_plain_citation_detector():
    found = lambda md: [(t, k) for _, t, k in plain_citations(md)]
    assert found("MCM (Ming et al., 2022) scores") == [("Ming et al., 2022", ["ming2022delving"])]
    assert found("GL-MCM (Miyai et al., IJCV 2025)") == [("Miyai et al., IJCV 2025", ["miyai2025gl"])]
    assert found("Sun et al. (ICML 2022) normalise") == [("Sun et al. (ICML 2022", ["sun2022knn"])]
    assert found("TAG (Liu & Zach, ECCV 2024)") == [("Liu & Zach, ECCV 2024", ["liu2024tag"])]
    assert found("as Ju et al. 2025 write") == [("Ju et al. 2025", ["ju2025delving"])]
    assert found("Welford (1962) keeps") == [("Welford (1962", ["welford1962note"])]
    assert found("[FLAIR](https://x.org) (Silva-Rodríguez et al., 2025)")[0][1] == ["silva2025flair"]
    for fine in ("MCM {cite:p}`ming2022delving` scores", "{cite:t}`ju2025delving` write", "Ju et al.'s benchmark",
                 "Ming et al., 2019", "`Ju et al. 2025` in code", "in 2022 Ming et al. showed", "Nobody et al. (2022)"):
        assert not found(fine), fine


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_citations_are_myst_roles(notebook):
    "A plain 'Surname et al. (2022)' does not link to the references page; {cite:t}`key` or {cite:p}`key` does."
    problems = [f"{notebook}.ipynb, cell {i}, line {line}: {text!r} -> {{cite:t}} or {{cite:p}} with " + " or ".join(keys)
                for i, md in markdown_cells(notebook) for line, text, keys in plain_citations(md)]
    if problems: pytest.fail("plain-text citations of works in nbs/references.bib:\n" + "\n".join(problems), pytrace=False)


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_named_authors_are_cited(notebook):
    "A notebook that names 'Surname et al.' cites, somewhere in its markdown, a work of that first author."
    md = markdown_cells(notebook)
    cited = {k.strip() for _, s in md for role in CITE_ROLE.findall(s) for k in role.split(",")}
    problems = [f"{notebook}.ipynb, cell {i}, line {prose(s).count(chr(10), 0, m.start()) + 1}: {m[0]!r} -> cite one of "
                + ", ".join(keys)
                for i, s in md for m in NAME_ONLY.finditer(prose(s))
                for keys in [[k for (name, _), ks in KEYS_OF.items() if name == m["surname"] for k in ks]] if not cited & set(keys)]
    if problems: pytest.fail("authors named but none of their works cited in this notebook:\n" + "\n".join(dict.fromkeys(problems)), pytrace=False)


def test_every_cited_key_is_in_the_bibliography():
    keys = {key for key, _, _ in ENTRIES} | set(re.findall(r"^@\w+\{([^,\s]+),", (ROOT / "nbs" / "references.bib").read_text(), re.M))
    unknown = [f"{nb}.ipynb, cell {i}: {k}" for nb in NOTEBOOKS for i, s in markdown_cells(nb)
               for role in CITE_ROLE.findall(s) for k in (k.strip() for k in role.split(",")) if k not in keys]
    if unknown: pytest.fail("citations of keys missing from nbs/references.bib:\n" + "\n".join(unknown), pytrace=False)


# --- optional deep dives: one convention in every chapter ---

DEEP_DIVE = " (deep dive, optional)"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_deep_dives_are_marked_one_way(chapter):
    "A section a first reading may skip ends its heading with ' (deep dive, optional)', and the chapter's opening says so."
    md = [s for _, s in markdown_cells(chapter)]
    headings = [line for s in md for line in s.splitlines() if line.startswith("#")]
    odd = [h for h in headings if re.search(r"deep[ -]dive|optional\)", h, re.I) and not h.endswith(DEEP_DIVE)]
    assert not odd, f"{chapter}: mark a deep dive by ending its heading with {DEEP_DIVE!r}: {odd}"
    if any(h.endswith(DEEP_DIVE) for h in headings):
        assert "*(deep dive, optional)*" in md[0], f"{chapter}: the opening cell should tell the reader that the sections marked *(deep dive, optional)* can be skipped"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_math_has_no_escaped_underscore(chapter):
    r"Inside $...$ an escaped underscore (`\_`, e.g. `\text{shard\_size}`) renders with its backslash: name the quantity instead."
    bad = [m.group(0) for _, s in markdown_cells(chapter) for m in re.finditer(r"\$[^$\n]*\\_[^$\n]*\$", s)]
    assert not bad, f"{chapter}: {bad[:3]}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_glue_falls_back_where_myst_nb_is_not_installed(chapter):
    "Colab has no myst_nb: a chapter that glues numbers into its prose must still run there."
    code = ["".join(c["source"]) for c in cells(chapter) if c["cell_type"] == "code"]
    bare = [c.splitlines()[0] for c in code if re.search(r"^from myst_nb import glue", c, re.M) and "except ImportError" not in c]
    assert not bare, f"{chapter} imports myst_nb's glue without a fallback: {bare}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_chapter_that_loads_an_open_clip_model_installs_the_vlm_extra(chapter):
    "Colab brings neither open_clip nor the course extra's packages; a chapter that loads an open_clip model must ask for both."
    code = ["".join(c["source"]) for c in cells(chapter) if c["cell_type"] == "code"]
    if any('"open_clip:' in c for c in code if not c.lstrip().startswith("#| export")):
        install = next(c for c in code if "google.colab" in c)
        assert re.search(r'proton-ood\[[a-z,]*\bvlm\b', install), f"{chapter} loads an open_clip model: its Colab cell must install the vlm extra"

