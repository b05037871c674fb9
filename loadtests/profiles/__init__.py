"""Iteration time models (`loadtests.sim.runner.IterationTimeModel` JSON files) measured by
`fairshare sim calibrate`.

`DEFAULT_PROFILE`: this machine's CPU calibration of the random tiny Llama, the model every report and
benchmark uses unless told otherwise (one home for the path).
"""

from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent
DEFAULT_PROFILE = PROFILES_DIR / "cpu-random-tiny.json"
