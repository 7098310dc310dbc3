"""Argument types the services' and the tools' command lines share."""

from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """An argparse ``type`` for a TCP port: 0-65535 (0: the system picks a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, not {value}")
    return value
