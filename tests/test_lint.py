"""The project's lint (ruff, configured in pyproject.toml) as part of the suite, so the README's test command is all
CI runs after installing and a contributor who runs it sees what CI sees.

Run: python -m pytest tests/test_lint.py -q
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
