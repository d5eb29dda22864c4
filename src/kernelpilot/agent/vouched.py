"""What a session's transcript may claim only where kernelpilot's side vouched for it: the judge's verdicts of the
run, its end, and the files of its best candidate.

The transcript (.kernelpilot/sessions/) and the best candidate's copy (.kernelpilot/best/) live in the workspace,
which a program the agent runs may write, and kernelpilot reads them back: `optimize --resume` and a resumed suite
take their best candidate and verdict from them, training takes a finished rollout's reward and RFT a transcript's
(tests/adversarial/test_agent_sessions.py). So the loop (which runs in kernelpilot's process, never the agent's)
also writes, for each verdict and end it appends, a signed entry in kernelpilot's cache folder (`harness/cache.py`),
which Landlock keeps the agent's commands and the judge's sandboxes from writing; and for each new best, the files
the judge saw. An entry names the workspace, the session and the SHA-256 of the transcript line it vouches for: a
line the agent wrote, or copied from another workspace's transcript, is vouched for by none. Where the cache folder
cannot be written, nothing is vouched for, and a resumed run starts with no best.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

RECORD_KIND = "session-record"
BEST_KIND = "session-best"


def line_digest(line: str) -> str:
    """The SHA-256 of a transcript line as written (without its newline)."""
    return hashlib.sha256(line.encode("utf-8")).hexdigest()


def vouch(transcript: Path, digest: str) -> None:
    """Record that kernelpilot wrote the line of `transcript` whose digest is `digest`."""
    _store(RECORD_KIND, _key(transcript, digest=digest), True)


def vouched(transcript: Path, digest: str | None) -> bool:
    """Whether kernelpilot vouched for that line of `transcript`."""
    from kernelpilot.harness.cache import load_entry

    return digest is not None and load_entry(RECORD_KIND, _key(transcript, digest=digest)) is True


def keep_best(transcript: Path, digest: str, files: dict[str, bytes]) -> None:
    """Keep the candidate files the judge saw for the verdict line `digest`, as the session's best."""
    encoded = {name: base64.b64encode(data).decode("ascii") for name, data in files.items()}
    _store(BEST_KIND, _key(transcript), {"digest": digest, "files": encoded})


def kept_best(transcript: Path) -> tuple[str, dict[str, bytes]] | None:
    """The verdict line's digest and the files of the session's best candidate, or None when none was kept."""
    from kernelpilot.harness.cache import load_entry

    value = load_entry(BEST_KIND, _key(transcript))
    if not isinstance(value, dict) or not isinstance(value.get("files"), dict):
        return None
    try:
        return str(value.get("digest")), {name: base64.b64decode(data) for name, data in value["files"].items()}
    except (TypeError, ValueError):
        return None


def _key(transcript: Path, **more: str) -> dict[str, str]:
    transcript = Path(transcript).resolve()
    # .kernelpilot/sessions/<id>.jsonl: the workspace is three folders up.
    return {"workspace": str(transcript.parents[2]), "session": transcript.stem, **more}


def _store(kind: str, key: dict[str, str], value: object) -> None:
    from kernelpilot.harness.cache import store_entry

    try:
        store_entry(kind, key, value)
    except OSError:
        pass  # an unwritable cache folder vouches for nothing: a resume then starts without a best
