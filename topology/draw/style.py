"""Sizes and colours of a cluster picture (sizes in inches, the layout's unit)."""

DPI = 150
MAX_FULL_NODES = 16
"""A datacenter with at most this many nodes shows every one of them."""
SHOWN_PER_GROUP = 3
"""Nodes shown per node group in a larger datacenter, before its "+N more" box."""
MAX_CELLS = 24  # boxes per datacenter; further node groups fold into one box
COLUMNS = 4

# Sizes, in inches.
MARGIN = 0.35
GPU, GPU_GAP, GPUS_PER_ROW = 0.17, 0.045, 8
PAD = 0.09  # inside a node box
MAX_INNER = 2.6  # widest content of a node box; longer names are cut short
NAME_H = 0.21
NVLINK_GAP, NVLINK_H = 0.05, 0.065
PCIE_H = 0.1  # room for the PCIe lines between the NVLink bar and the NICs
NIC_W, NIC_H = 0.11, 0.075
CELL_GAP = 0.2
BAND_PAD = 0.075  # NVLink-domain band around its nodes
DC_PAD = 0.22
NET_H = 0.32
WAN_W = 6.0  # points
LANE = 0.45  # height of a WAN path routed above the datacenters

# Colours (GPU models: Okabe-Ito, readable by colour-blind viewers; no green or red,
# which mean NVLink and WAN).
GPU_COLOURS = ("#0072B2", "#E69F00", "#CC79A7", "#56B4E9", "#8C6D31", "#6A51A3",
               "#F0E442", "#7F7F7F")
NVLINK = "#76B900"
BAND, DOMAIN_INK = "#EAF5D6", "#4E7A00"
PCIE = "#A0A0A0"
NIC = "#2B2B2B"
TRAINER = "#7B3294"
NETWORK = "#3D5A80"
WAN = "#C0392B"
INK, MUTED, EDGE = "#1F1F1F", "#6B6B6B", "#8C8C8C"
DC_FACE, DC_EDGE = "#F6F8FB", "#9AA8BA"
