"""Headless Chromium for the chat page tests: Debian's build, driven by playwright."""

from __future__ import annotations

from typing import Any

CHROMIUM = "/usr/bin/chromium"
# Quiet and self-contained: no sandbox (root in CI), no GPU, nothing fetched in the background.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def launch_chromium(playwright: Any) -> Any:
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
