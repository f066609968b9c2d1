"""docs/protocol.md lists every message in the table, with its request and reply fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

# The engine's messages join the table on import; without this they are checked only if another test imports them.
import remote_g2.adapters.reference.messages  # noqa: F401
import remote_g2.adapters.vllm.tp_links  # noqa: F401

from remote_g2.protocol.messages import MESSAGES

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def _sections() -> dict[str, str]:
    text = DOC.read_text()
    parts = re.split(r"^### (\S+)\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_every_message_has_a_section_naming_its_fields():
    sections = _sections()
    missing = sorted(set(MESSAGES) - set(sections))
    assert not missing, f"docs/protocol.md lacks sections for {missing}"
    for name, spec in MESSAGES.items():
        body = sections[name]
        for cls in (spec.request, spec.reply) if spec.reply is not None else (spec.request,):
            for f in dataclasses.fields(cls):
                assert re.search(rf"\b{f.name}\b", body), f"{name}: field {f.name!r} not documented"


def test_no_section_for_a_message_that_does_not_exist():
    stale = sorted(set(_sections()) - set(MESSAGES))
    assert not stale, f"docs/protocol.md documents unknown messages {stale}"
