"""scripts/device_jobs.sh: every job its header lists has a case in the dispatcher, and every case is listed."""

import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_jobs.sh"


def _listed_and_cases():
    text = SCRIPT.read_text()
    header = text[text.index("# jobs:"):text.index("# A short table")]
    listed = set(re.findall(r"^#   ([a-z]+)\s", header, flags=re.M))
    cases = set(re.findall(r"^    ([a-z]+)\)$", text, flags=re.M))
    return listed, cases


def test_every_listed_job_has_a_case_and_every_case_is_listed():
    listed, cases = _listed_and_cases()
    assert {"build", "kda", "kdabwd", "abbuild", "ablight", "ab"} <= listed, sorted(listed)
    missing = sorted(listed - cases)
    assert not missing, f"listed without a case (the call would print 'unknown job'): {missing}"
    assert cases - listed == set(), f"cases not in the header's job list: {sorted(cases - listed)}"
