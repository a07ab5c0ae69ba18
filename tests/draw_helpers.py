"""Helpers of the picture tests: PNG sizes, and DGX clusters of any size."""

from __future__ import annotations

import struct
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk, after checking the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def dgx_cluster(num_nodes: int) -> str:
    """YAML of `num_nodes` DGX H100 split over two datacenters joined by a WAN."""
    half = num_nodes // 2
    return f"""
version: 1
name: dgx-{num_nodes}
node_types:
  dgx-h100:
    gpus: 8
    gpu: {{model: H100-SXM, memory: 80GB}}
    nvlink: {{bandwidth: 450GB/s, latency: 2us}}
    pcie: {{bandwidth: 64GB/s, latency: 2us}}
    nics: {{count: 8, bandwidth: 400Gbps, kind: rdma, latency: 5us}}
datacenters:
  - name: east
    network: {{oversubscription: 2.0, nodes_per_leaf: 32, latency: 1us}}
    nodes:
      - {{name: trainer, type: dgx-h100}}
      - {{name: "e-{{i}}", type: dgx-h100, count: {half - 1}}}
  - name: west
    nodes:
      - {{name: "w-{{i}}", type: dgx-h100, count: {num_nodes - half - 18}}}
      - {{name: "nvl-{{i}}", type: dgx-h100, count: 18, nvlink_domain: rack-0}}
wan:
  - {{between: [east, west], bandwidth: 400Gbps, latency: 30ms}}
roles:
  trainer: [trainer]
  rollout: ["e-*", "w-*", "nvl-*"]
"""


__all__ = ["PNG_SIGNATURE", "dgx_cluster", "png_size"]
