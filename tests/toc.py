"""The chapters of the course, read from `_toc.yml`, for the tests that walk the book."""
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]


def toc_files(node):
    "Every file named in a `_toc.yml` tree, in order."
    if isinstance(node, list): return [f for child in node for f in toc_files(child)]
    if not isinstance(node, dict): return []
    own = [node[k] for k in ("root", "file") if k in node]
    return own + [f for k in ("parts", "chapters", "sections") for f in toc_files(node.get(k, []))]


TOC_FILES = list(dict.fromkeys(toc_files(yaml.safe_load((ROOT / "_toc.yml").read_text()))))
