"""Is the test environment the locked one? Prints the versions that matter, then fails on any
difference from requirements-lock.txt (a missing, extra or other-version package).

    python scripts/check_env.py [requirements-lock.txt]

Run by scripts/test.sh inside its own virtual environment, so a machine's leftover packages
can never make a run green.
"""

from __future__ import annotations

import platform
import re
import sys
from importlib import metadata
from pathlib import Path

# printed first, in this order, so a log says at a glance what the run used
SHOWN = ["torch", "transformers", "safetensors", "pytest", "nbmake", "jupyter-book", "sphinx", "triton",
         "fastapi", "uvicorn", "httpx", "openai", "ruff"]
# present in any venv or installed from the checkout itself, never in the lock
NOT_LOCKED = {"pip", "engine-lib"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_version(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0': the local label names the wheel's build, not the release."""
    return version.split("+", 1)[0]


def read_lock(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"lock line is not 'name==version': {line!r}")
        pins[canonical(name)] = version.strip()
    return pins


def mismatches(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    """Every way the installed set differs from the pinned one, as readable lines."""
    problems = []
    for name, want in sorted(pins.items()):
        have = installed.get(name)
        if have is None:
            problems.append(f"missing: {name}=={want}")
        elif base_version(have) != base_version(want):
            problems.append(f"wrong version: {name} {have} installed, lock says {want}")
    for name, have in sorted(installed.items()):
        if name not in pins and name not in NOT_LOCKED:
            problems.append(f"not in the lock: {name}=={have}")
    return problems


def installed_versions() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}


def main(argv: list[str]) -> int:
    lock = Path(argv[0] if argv else "requirements-lock.txt")
    installed = installed_versions()
    print(f"test environment: Python {platform.python_version()} at {sys.prefix}")
    print("  " + ", ".join(f"{n} {installed[n]}" for n in SHOWN if n in installed))
    problems = mismatches(read_lock(lock.read_text()), installed)
    if problems:
        print(f"the environment differs from {lock} ({len(problems)}):", *problems, sep="\n  ", file=sys.stderr)
        print("rebuild it (delete the venv, run scripts/test.sh) or refresh the lock (scripts/update_lock.sh)",
              file=sys.stderr)
        return 1
    print(f"  matches {lock} ({len(installed)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
