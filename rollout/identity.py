"""What a checkpoint is, for the pool to refuse an engine that serves another model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from weightfabric.fabric.errors import BadRequestError

# fields that differ between copies of the same model (where, when, which dtype it was saved in)
_VOLATILE = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures_file"}


def fingerprint(checkpoint: str | Path) -> str:
    """A short hash of the checkpoint's ``config.json``, without the fields copies differ in.

    Raises:
        BadRequestError: no readable ``config.json`` there.
    """
    path = Path(checkpoint) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadRequestError(f"{path}: not a model checkpoint's config ({exc})") from None
    if not isinstance(config, dict):
        raise BadRequestError(f"{path}: not a model checkpoint's config (not a JSON object)")
    kept = {k: v for k, v in config.items() if k not in _VOLATILE}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


__all__ = ["fingerprint"]
