"""Verify and time this workspace's ModelNew against model.py (protected: do not edit).

    python benchmark.py [--json]

Runs `kernelpilot eval` on the folder this file is in: it builds kernels/, checks ModelNew's outputs
against Model's on fresh inputs, and times both, with the same rules the agent is judged by.
"""

import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.exit(subprocess.call([sys.executable, "-m", "kernelpilot", "eval", str(here), *sys.argv[1:]]))
