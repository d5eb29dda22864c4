"""`python -m unconfined_worker`: the judge's worker (`kernelpilot.harness.worker`), its sandboxes unconfined as on a
kernel without Landlock; `confinement_testing.unconfined_judges` makes Judges start it."""

from confinement_testing import unconfine_sandboxes
from kernelpilot.harness.worker import main

if __name__ == "__main__":
    unconfine_sandboxes()
    main()
