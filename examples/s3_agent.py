"""The research agent of research_agent.py, checkpointing to an S3 bucket.

Configured by the environment only, the way a deployed agent would be::

    export DURABLE_STEPS_STORE=s3://my-bucket/agents
    export AWS_ENDPOINT_URL_S3=http://localhost:9000   # R2, MinIO, SeaweedFS; omit for AWS
    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...
    python examples/s3_agent.py --crash-at send && python examples/s3_agent.py

The checkpoint lives in the bucket, so the rerun can happen on another machine.
(The fake email API's records stay in a local file, ./fake-email-outbox.json.)
"""

from __future__ import annotations

import os
import sys

from research_agent import build_agent, parse_args


def main() -> None:
    url = os.environ.get("DURABLE_STEPS_STORE", "")
    if not url.startswith("s3://"):
        sys.exit(
            f"s3_agent.py: DURABLE_STEPS_STORE must be an s3://bucket/prefix URL, not {url!r}. "
            "Set AWS_ENDPOINT_URL_S3 too for R2, MinIO or SeaweedFS, or run "
            "research_agent.py to use a local directory instead."
        )
    args = parse_args(store_option=False)
    # store=None: the library reads $DURABLE_STEPS_STORE itself, as any script would.
    agent = build_agent(None, outbox=args.outbox, crash_at=args.crash_at, fast=args.fast)
    agent.run(args.run_id)


if __name__ == "__main__":
    main()
