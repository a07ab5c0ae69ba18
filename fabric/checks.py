"""Checks of what callers ask the data plane for, made before anything changes.

Version requests (`check_version`) and model names (`check_model_name`).
"""

from __future__ import annotations

from typing import Literal

from weightfabric.fabric.errors import BadRequestError
from weightfabric.fabric.regions import region_name
from weightfabric.fabric.transports.wire import MAX_NAME

MAX_VERSION = (1 << 63) - 1
"""The largest version number a region name must still have room for."""


def check_version(version: object) -> int | Literal["latest"]:
    """``version`` if it names a version to fetch: an ``int > 0`` or ``"latest"``.

    The one check every fetch entry point (`ModelStore.fetch`, `fetch_async`,
    `ReshardReader.fetch`, `fetch_resharded`) makes before it changes anything.

    Raises:
        BadRequestError: anything else (None, 0, negative numbers, bools, floats,
            strings other than ``"latest"``).
    """
    if version == "latest" and isinstance(version, str):
        return "latest"
    if isinstance(version, int) and not isinstance(version, bool) and version > 0:
        return version
    raise BadRequestError(f"cannot fetch version {version!r}: a version is an int > 0 or "
                          "'latest' (e.g. the number publish or wait_version returned)")


def check_model_name(model: object, shard: int = 0) -> str:
    """``model`` if every version of it can be exposed on a read server.

    A replica is exposed as `region_name` ``(model, version, shard)``, which the read
    server takes only up to `wire.MAX_NAME` bytes of UTF-8; checking this before the
    hub is asked for a version means a bad name never leaves a version half published.

    Raises:
        BadRequestError: not a string, empty, not encodable as UTF-8, or too long.
    """
    if not isinstance(model, str) or not model:
        raise BadRequestError(f"model name {model!r}: give a non-empty string, e.g. 'policy'")
    try:
        nbytes = len(region_name(model, MAX_VERSION, shard).encode())
    except UnicodeEncodeError as exc:
        raise BadRequestError(f"model name {model!r} is not valid UTF-8 ({exc.reason}); "
                              "use another name") from None
    if nbytes > MAX_NAME:
        raise BadRequestError(f"model name of {len(model.encode())} bytes is too long: its "
                              f"replicas' region names would exceed the read server's "
                              f"{MAX_NAME} bytes; use a name under {MAX_NAME - 32} bytes")
    return model


__all__ = ["MAX_VERSION", "check_model_name", "check_version"]
