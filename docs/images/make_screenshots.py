"""Take the web page's screenshots for the docs: the list of runs and a run's page.

    python docs/images/make_screenshots.py

Makes a store of example runs in a temporary directory (``tests/uiapp.py``:
a completed research run, a ticket waiting for approval, a failed one, and a
refund whose process died inside its effect), serves it with the page
(``durable_steps.ui``) on a free loopback port, and saves
``docs/images/ui-runs.png`` and ``docs/images/ui-run.png`` with Debian's
chromium driven by Playwright.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import uvicorn
from playwright.sync_api import sync_playwright

import durable_steps as ds
from durable_steps.ui import Config, create_app

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        app = [sys.executable, str(ROOT / "tests" / "uiapp.py"), str(store)]
        subprocess.run([*app, "populate"], check=True)
        subprocess.run([*app, "crash"], check=False)  # dies inside its effect: in doubt
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = Config(ds.LocalStore(store), port=port)
        server = uvicorn.Server(
            uvicorn.Config(create_app(config), port=port, log_level="warning", ws="none")
        )
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1200, "height": 560})
            page.goto(url + "/")
            page.screenshot(path=str(HERE / "ui-runs.png"))
            page.set_viewport_size({"width": 1200, "height": 1400})
            page.goto(url + "/runs/refunds/order-17")
            page.screenshot(path=str(HERE / "ui-run.png"))
            browser.close()
        server.should_exit = True
    print("saved", HERE / "ui-runs.png", "and", HERE / "ui-run.png")


if __name__ == "__main__":
    main()
