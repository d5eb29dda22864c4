"""SHA-256 of every file the built-in policy renders for every problem of a folder (a script, not a test).

For each problem, both analyses (the first answer and the rounding-faithful fallback) are rendered: every file of
`render_all`, then each group's kernel with every launch candidate. A refactor of the policy must leave the
digests unchanged; compare two runs with `--compare`.

    python3 scripts/policy_render_digest.py examples --out before.json
    python3 scripts/policy_render_digest.py examples --compare before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from kernelpilot.policy.analysis import analyze
from kernelpilot.policy.families import launch_candidates, render_all, render_kernel
from kernelpilot.problem import load_problem


def digests(folder: Path) -> dict[str, str]:
    """'problem/analysis/file' (and '.../candidate N' for each launch candidate) -> sha256 of the rendered text."""
    found: dict[str, str] = {}
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        problem = load_problem(path)
        for faithful in (False, True):
            analysis = analyze(problem, faithful=faithful)
            prefix = f"{path.stem}/{'faithful' if faithful else 'first'}"
            found[f"{prefix}/blockers"] = _sha(analysis.blockers() if not analysis.supported else "supported")
            if not analysis.supported:
                continue
            for file in render_all(problem, analysis):
                found[f"{prefix}/{file.path}"] = _sha(file.content)
            for group in analysis.generated_groups:
                for index, config in enumerate(launch_candidates(group)):
                    kernel = render_kernel(group, config)
                    found[f"{prefix}/{kernel.path}/candidate {index} {config.label}"] = _sha(kernel.content)
    return found


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, help="write the digests as JSON")
    parser.add_argument("--compare", type=Path, help="compare with digests written earlier; exit 1 on a difference")
    args = parser.parse_args()
    found = digests(args.folder)
    if args.out:
        args.out.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    if args.compare:
        before = json.loads(args.compare.read_text())
        changed = sorted(k for k in before.keys() | found.keys() if before.get(k) != found.get(k))
        for key in changed:
            print(f"differs: {key}")
        print(f"{len(found)} rendered files, {len(changed)} differ from {args.compare}")
        return 1 if changed else 0
    print(f"{len(found)} rendered files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
