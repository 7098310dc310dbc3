"""The bench's progress line keeps its counts and time in a narrow, non-terminal console."""

from __future__ import annotations

import io
import re

from rich.console import Console

from ops.bench.runner import _make_progress


def test_a_long_description_wraps_and_the_counts_and_time_stay_whole() -> None:
    out = io.StringIO()
    progress = _make_progress(Console(file=out, width=80, force_terminal=False))
    progress.start()
    task = progress.add_task("http://127.0.0.1:8080/v1 · poisson 2 req/s", total=20, inflight=0, errors=0)
    progress.update(task, completed=20)
    progress.stop()
    text = out.getvalue()
    assert "20/20" in text and "err 0" in text
    assert re.search(r"\d:\d\d:\d\d", text), text  # the elapsed time, not "0:00:…"
    assert "…" not in text and "poisson 2 req/s" in text.replace("\n", " "), text
