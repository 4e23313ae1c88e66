"""Print the uv overrides that pin each runtime requirement to the oldest release it allows.

CI's "oldest releases" lane installs the test extra with these overrides, so the library
is tested against the floor of every `>=` it declares in pyproject.toml: the core
dependencies and every extra a user installs (gcs, azure, ray, otel, pydantic-ai,
openai-agents, ui). The test and docs extras are tools, not claims, and stay as locked.

boto3 is left out: the test extra needs botocore>=1.44 (1.43 hangs on SeaweedFS's
100 Continue), and each boto3 release pins its botocore, so the oldest boto3 the tests
can run is the one that botocore floor allows, which the resolver then picks itself.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

TOOLS = {"test", "docs"}
NOT_PINNED = {"boto3"}  # see the module docstring


def floors(pyproject: Path) -> list[str]:
    """`name==floor` for each `name>=floor` requirement users install."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra, items in project["optional-dependencies"].items():
        if extra not in TOOLS:
            requirements += items
    pins = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?>=([^,;\s]+)(?:,.*)?", requirement)
        if match and match[1] not in NOT_PINNED and not match[1].startswith("durable-steps"):
            pins[match[1]] = f"{match[1]}=={match[2]}"
    return sorted(pins.values())


if __name__ == "__main__":
    print("\n".join(floors(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))))
