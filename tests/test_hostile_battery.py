"""CI runs a sample of the hostile-input battery (tests/hostile_battery.py; the whole battery runs as a
script): each case in its own process, with a timeout and a memory cap."""

from __future__ import annotations

import io
import sys

import hostile_battery as battery
import pytest

# One or two of each kind: model-folder paths and files, config values, weights, templates, prompts and
# arguments, sessions, profiles and saved state.
SAMPLE = (
    "index/entry-0:'../outside.safetensors'",
    "files/config.json-fifo",
    "config/num_hidden_layers=1000000000",
    "weights/nan",
    "template/loop-forever",
    "prompt/lone-surrogate-1",
    "session/dropped-unstarted-stream-releases",
    "profile/deep-arrays",
    "profile/special-dev-zero",
    "state/last_used-fifo",
)


def test_the_battery_has_a_hundred_cases_or_more_with_unique_names():
    names = [c.name for c in battery.CASES]
    assert len(names) >= 100 and len(set(names)) == len(names)
    assert set(SAMPLE) <= set(names)


@pytest.mark.skipif(sys.platform == "win32", reason="resource limits, FIFOs")
def test_a_sample_of_the_battery_passes_each_in_its_own_capped_process():
    cases = [c for c in battery.CASES if c.name in SAMPLE]
    out = io.StringIO()
    passed, total, failures = battery.run_battery(cases, jobs=2, timeout=60, mem_mb=4096, out=out)
    assert (passed, total) == (len(SAMPLE), len(SAMPLE)), out.getvalue()
