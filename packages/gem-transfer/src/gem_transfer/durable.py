"""Files that survive a crash once written: a store lists a file only after its bytes and its name are on disk.

A rename is atomic for readers, not durable: after a power loss the new name (or a listing written later) can be
on disk while the file's bytes are not. Syncing the file before the rename, and its folder after, orders them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def sync_file(path: Path) -> None:
    """Flush ``path``'s bytes to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sync_folder(path: Path) -> None:
    """Flush ``path``'s entries (names created, renamed or removed in it) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def replace_synced(staged: Path, path: Path) -> None:
    """Move the written file ``staged`` to ``path`` durably: its bytes, then its name."""
    sync_file(staged)
    os.replace(staged, path)
    sync_folder(path.parent)


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Replace ``path`` atomically and durably: a reader (or a restarted pass) sees the old file or the new one,
    never half, and a file it lists was synced before it."""
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(json.dumps(value, indent=1) + "\n")
    replace_synced(staged, path)
