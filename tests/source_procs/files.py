"""Files the helper processes hand to the tests that poll for them."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_whole"]


def write_whole(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` so that a test polling for it never reads it half-written.

    The bytes go to a temporary file beside it (named after this process, so
    two writers never share one) that is then renamed over ``path``.
    """
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)
