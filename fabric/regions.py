"""Names shared by publishers and readers: how a replica is named on a read server."""


def region_name(model: str, version: int, shard: int = 0) -> str:
    """The name under which a worker's read server exposes a replica of ``shard``."""
    return f"{model}/v{version}/s{shard}"


__all__ = ["region_name"]
