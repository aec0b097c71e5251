"""Ju et al.'s hierarchical prompts, read from their published notebooks without running them.

Ju et al. (2025) keep their prompts in the first code cell of each notebook, as ``in_class = ...``: a list (one prompt
per class, in the order of ``in_dir``) for one prompt per class, a dict {class key: [descriptions]} for the deeper
levels. These functions find those assignments with ``ast`` and read their values with ``ast.literal_eval``: the code
is parsed, never executed. Only the standard library is used.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path


def notebook_literals(path: Path, # a Jupyter notebook
                      names: tuple[str, ...] = ("in_class", "in_dir"), # the variables to read
                      ) -> dict:
    """The literal values assigned at top level to ``names`` in a notebook's first code cell (the last assignment wins)."""
    path = Path(path)
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        source = next("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    except (ValueError, KeyError, TypeError, StopIteration) as err:
        raise ValueError(f"{path} is not a notebook with a code cell ({type(err).__name__}: {err})") from None
    try:
        tree = ast.parse(source)
    except (SyntaxError, MemoryError, RecursionError) as err:  # the last two: nested too deep for the parser
        raise ValueError(f"{path}: the first code cell is not Python that can be read ({type(err).__name__}: {err})") from None
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in names:
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except (ValueError, TypeError, MemoryError, RecursionError):  # TypeError: an unhashable dict key or set member
                raise ValueError(f"{path}: {node.targets[0].id} is not a literal ({ast.unparse(node.value)[:80]}); "
                                 "it is read, never run") from None
    return found


def read_prompts(path: Path, # one of Ju et al.'s notebooks
                 class_keys: dict[str, str], # their class key (an in_dir entry or an in_class key) -> our class folder
                 ) -> dict[str, list[str]]:
    """One prompt set: class folder -> prompts, for every class folder of ``class_keys``, in its order."""
    found = notebook_literals(path)
    if "in_class" not in found:
        raise ValueError(f"{path}: the first code cell assigns no in_class")
    in_class = found["in_class"]
    if isinstance(in_class, list):
        in_dir = found.get("in_dir")
        if not isinstance(in_dir, list) or len(in_dir) != len(in_class):
            raise ValueError(f"{path}: in_class lists {len(in_class)} prompts but in_dir is {in_dir!r}; need one folder per prompt")
        given = [(key, [prompt]) for key, prompt in zip(in_dir, in_class)]
    elif isinstance(in_class, dict):
        given = list(in_class.items())
    else:
        raise ValueError(f"{path}: in_class must be a list or a dict of prompts, got {in_class!r:.80}")
    prompts = {}
    for key, texts in given:
        if key not in class_keys:
            raise ValueError(f"{path}: unknown class key {key!r}; expected one of {list(class_keys)}")
        folder = class_keys[key]
        if folder in prompts:
            raise ValueError(f"{path}: class {folder!r} is given twice")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
            raise ValueError(f"{path}: the prompts of {key!r} must be a non-empty list of non-empty strings, got {texts!r:.80}")
        prompts[folder] = texts
    folders = list(dict.fromkeys(class_keys.values()))
    missing = [f for f in folders if f not in prompts]
    if missing:
        raise ValueError(f"{path}: no prompts for the classes {missing}")
    return {f: prompts[f] for f in folders}


def prompt_sets(bench, # a common.Benchmark
                paths: dict[str, Path], # manifest key -> local file
                ) -> dict[str, dict[str, list[str]]]:
    """Every prompt set of a benchmark: set name -> class folder -> prompts."""
    return {name: read_prompts(paths[key], bench.prompt_classes) for name, key in bench.prompt_sources.items()}
