"""The normal mode's config that ``ptxforge bench ep`` measured fastest, stored per GPU
model and group size, and what ``Buffer.get_dispatch_config`` returns from it.

One config serves a dispatch and its combine: the combine must run on the dispatch's
channels, and the rings' slots set where the dispatch rings begin in the buffer. The pick
is the config with the least dispatch + combine time within the SM budget the bench was
given, and serves buffers of that budget only (a larger one runs faster on all its SMs,
a smaller one cannot take it); it is kept in ``ep_configs.json`` in ptxforge's cache folder (``PTXFORGE_CACHE_DIR``),
written whole to a temporary file and renamed over the old one, so a reader never sees
half of it. No file, or no entry for this GPU and group size: DeepEP's defaults (20 SMs,
128 slots a ring).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .. import settings

FILE = "ep_configs.json"


def path() -> Path:
    return settings.cache_dir() / FILE


def _key(device: str, ranks: int) -> str:
    return f"{device}, {ranks} ranks"


def load(device: str, ranks: int) -> tuple[int, int, int] | None:
    """(num_sms, ring_slots, sm_budget) stored for ``device`` (its name) and ``ranks``, or
    None."""
    try:
        entry = json.loads(path().read_text()).get(_key(device, ranks))
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict):
        return None
    picked = tuple(entry.get(name) for name in ("num_sms", "ring_slots", "sm_budget"))
    if any(type(value) is not int for value in picked):
        return None
    return picked


def store(device: str, ranks: int, num_sms: int, ring_slots: int, sm_budget: int,
          **measured) -> Path:
    """Keep (num_sms, ring_slots), picked within ``sm_budget`` SMs, for ``device`` and
    ``ranks`` beside the other entries, with what was measured (``measured``: e.g. the
    times); returns the file."""
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        entries = json.loads(target.read_text())
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[_key(device, ranks)] = dict(num_sms=num_sms, ring_slots=ring_slots,
                                        sm_budget=sm_budget, **measured)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=FILE, suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise
    return target
