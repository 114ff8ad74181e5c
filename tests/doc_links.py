"""Relative links of the generated tables (no third-party imports: ``scripts/compat_table.py`` reads it too)."""

from __future__ import annotations

import re


def relink(text: str) -> str:
    """``docs/models.md``'s relative links (``[x](families.md)``) as seen from ``docs/compat/``."""
    return re.sub(r"\]\((?![a-z]+:|#|\.\./)([^)\s]+)\)", r"](../\1)", text)
