"""Mutation check: small, plausible mistakes in Algorithm 1, made in the library one at a time, must each make the
reference tests fail. A mutation that survives means the tests do not pin that part of the specification.

Each mutation is applied to a copy of `proton/` in a temporary folder, and `tests/test_reference.py` runs against the
copy in a fresh interpreter (about ten seconds each)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
MUTATIONS = {  # name: (file of proton/, the code, the mistake)
    "gate > instead of >=": ("bank.py", "return confidence >= gamma", "return confidence > gamma"),
    "fusion weights swapped": ("fusion.py", "return alpha * base + (1 - alpha) * proto", "return (1 - alpha) * base + alpha * proto"),
    "Welford after scoring (step path)": ("detector.py", "var = self.welford.update(b)", "var = self.welford.var; self.welford.update(b)"),
    "Welford after scoring (engine)": ("engine.py", "var, welford = running_variance(base, welford)",
                                       "var, welford = running_variance(base, welford); var = torch.cat([var[:1] * 0, var[:-1]])"),
    "Welford after scoring (one image)": ("engine.py", "var, score = welford.update(base), base", "var, score = welford.var, base; welford.update(base)"),
    "calibration after the gate (engine)": ("engine.py", "calibrated = (before >= c.k_min).all(1)",
                                            "calibrated = (before + F.one_hot(predicted, C) * gated[:, None] >= c.k_min).all(1)"),
    "calibration after the gate (step path)": ("detector.py", "        var = self.welford.update(b)\n        if calibrated:",
                                               "        var = self.welford.update(b)\n        if gate: bank.add(cls, E[t]); calibrated = calibrated or bank.calibrated(c.k_min); gate = False\n        if calibrated:"),
    "calibration one entry early (one image)": ("engine.py", "if min(counts.tolist()) >= config.k_min:", "if min(counts.tolist()) >= config.k_min - 1:"),
    "FIFO evicts the newest (step path)": ("bank.py", "self.entries[c, :-1] = self.entries[c, 1:].clone()", "self.entries[c, :-1] = self.entries[c, :-1].clone()"),
    "FIFO evicts the wrong entry (engine)": ("engine.py", "old = before[grouped, cls] - M ", "old = before[grouped, cls] - M + 1 "),
    "FIFO evicts the newest (one image)": ("engine.py", "_shift_up(views.address + k * entries.strides[0], entries.strides[1], m); m -= 1", "m -= 1"),
}


def run_reference_tests(tmp_path, mutation=None):
    "Run tests/test_reference.py against a copy of proton/ with `mutation` (file, code, mistake) applied; the finished process."
    shutil.copytree(ROOT / "proton", tmp_path / "proton")
    shutil.copytree(ROOT / "tests", tmp_path / "tests", ignore=lambda d, names: [n for n in names if n not in ("reference.py", "test_reference.py")])
    if mutation:
        file, code, mistake = mutation
        target = tmp_path / "proton" / file
        source = target.read_text()
        assert source.count(code) == 1, f"the code to mutate is not in proton/{file} exactly once: {code!r}"
        target.write_text(source.replace(code, mistake))
    env = os.environ | dict(PYTHONPATH=f"{tmp_path}{os.pathsep}{tmp_path / 'tests'}", OMP_NUM_THREADS="1")
    probe = subprocess.run([sys.executable, "-c", "import proton; print(proton.__file__)"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert probe.stdout.strip() == str(tmp_path / "proton" / "__init__.py"), probe.stdout + probe.stderr  # the copy is what runs
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/test_reference.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_the_unmutated_copy_passes(tmp_path):
    "The harness itself: without a mutation the copied tests pass, so a failure below comes from the mutation."
    run = run_reference_tests(tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_reference_tests_catch_the_mutation(name, tmp_path):
    run = run_reference_tests(tmp_path, MUTATIONS[name])
    assert run.returncode == 1, f"the mutation {name!r} survived the reference tests (or broke them otherwise):\n{run.stdout[-2000:]}"
