"""Argument types the benchmark scripts share: argparse refuses a bad value in one line (`script: error: argument ...`),
before the script does any work."""
import argparse
import os
from pathlib import Path


def refuse(message): # what is wrong with the value
    "Raise argparse's error for a bad value: one line, naming the argument."
    raise argparse.ArgumentTypeError(message)


def usable_device(name): # cpu, cuda, cuda:N
    "`name`, once a model can run there on this machine (`model_device`'s check)."
    from proton.detector import model_device
    try: model_device(name)
    except ValueError as e: refuse(str(e))
    return name


def whole(text, # the value on the command line
          least): # the smallest allowed
    "`text` as an integer of at least `least`."
    try: n = int(text)
    except ValueError: refuse(f"not a whole number: {text!r}")
    if n < least: refuse(f"must be at least {least}, got {n}")
    return n


def positive(text): # the value on the command line
    "A whole number of at least 1."
    return whole(text, 1)


def non_negative(text): # the value on the command line
    "A whole number of at least 0."
    return whole(text, 0)


def positives(text): # comma-separated values
    "Comma-separated whole numbers of at least 1, as a list."
    return [positive(t) for t in text.split(",")]


def shares(text): # comma-separated worker shares
    "Comma-separated worker shares as a list of floats, each from 0 to 1 (extract's `worker_fraction` checks them)."
    from proton.models.extract import worker_fraction
    out = []
    for t in text.split(","):
        try: worker_fraction(share := float(t))
        except ValueError: refuse(f"a worker share is a number from 0 to 1, got {t!r}")
        out.append(share)
    return out


def names(*choices): # the names allowed
    "An argument type for comma-separated names, each one of `choices`; it gives them as a list."
    def parse(text):
        for name in text.split(","):
            if name not in choices: refuse(f"unknown {name!r}: choose from {', '.join(choices)}")
        return text.split(",")
    return parse


def writable(path): # a file the script writes when it is done
    "`path`, once its folder is found to exist and to take files: checked before the run rather than after it."
    folder = Path(path).parent
    if not folder.is_dir(): refuse(f"{path}: there is no folder {str(folder)!r} to write it in")
    if Path(path).is_dir(): refuse(f"{path} is a folder, not a file")
    if not os.access(folder, os.W_OK): refuse(f"{path}: the folder {str(folder)!r} cannot be written to")
    return path
