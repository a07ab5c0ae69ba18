"""A NIXL read tells its pieces as they land (`NixlEngine.read` with a `Landing`).

NIXL is not needed: a stand-in agent with NIXL's Python API copies the bytes of each
posted READ when the test lets it complete, so the order in which pieces are told and
what is in place at each is checked exactly. `tests/fabric/test_nixl.py` runs the real
thing where the rdma extra is installed.
"""

import ctypes

import pytest
import torch

from weightfabric.fabric.errors import SourceLostError
from weightfabric.fabric.transports.base import Landing
from weightfabric.fabric.transports.nixl import GENERATION, NixlEngine

PIECE = 1000
NBYTES = 3 * PIECE + 500


class StandInAgent:
    """NIXL's agent calls the engine makes; READ number k completes once `done > k`."""

    def __init__(self) -> None:
        self.posted: list[tuple[int, int, int]] = []  # (local address, remote address, bytes)
        self.done = 0
        self.released: list[int] = []
        self.fail_at: int | None = None

    def register_memory(self, regs, mem):
        return regs

    def get_agent_metadata(self):
        return b"me"

    def add_remote_agent(self, meta):
        return meta

    def get_xfer_descs(self, descs, mem):
        return descs

    def initialize_xfer(self, op, local, far, peer):
        assert op == "READ" and peer == "holder"
        (addr, nbytes, _), = local
        (remote, remote_bytes, _), = far
        assert nbytes == remote_bytes
        self.posted.append((addr, remote, nbytes))
        return len(self.posted) - 1

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        if handle == self.fail_at:
            return "ERR"
        if handle >= self.done:
            return "PROC"
        addr, remote, nbytes = self.posted[handle]
        ctypes.memmove(addr, remote, nbytes)
        return "DONE"

    def release_xfer_handle(self, handle):
        self.released.append(handle)

    def remove_remote_agent(self, name):
        pass


def engine_with(agent: StandInAgent) -> NixlEngine:
    engine = NixlEngine("reader", publish=lambda name, meta: None,
                        lookup=lambda name: GENERATION.pack(1) + b"holder")
    engine._agent = agent
    return engine


def test_each_piece_is_told_once_it_and_those_before_it_landed():
    source = torch.arange(NBYTES, dtype=torch.int64).remainder(251).to(torch.uint8)
    out = torch.zeros(NBYTES, dtype=torch.uint8)
    agent = StandInAgent()
    told: list[tuple[int, bool, int]] = []

    def call(n: int) -> None:  # (bytes told, all in place, READs posted by then)
        told.append((n, torch.equal(out[:n], source[:n]), len(agent.posted)))
        agent.done += 1  # the next READ completes only after this piece was told

    agent.done = 1
    remote = {"agent": "holder", "addr": source.data_ptr(), "dev": 0, "mem": "DRAM", "gen": 1}
    engine_with(agent).read(remote, 0, out, timeout=5, landing=Landing(PIECE, call))
    assert told == [(1000, True, 4), (2000, True, 4), (3000, True, 4), (3500, True, 4)]
    assert [n for *_, n in agent.posted] == [1000, 1000, 1000, 500]  # all posted at once
    assert sorted(agent.released) == [0, 1, 2, 3]
    assert torch.equal(out, source)


def test_a_failed_piece_fails_the_read_after_telling_the_pieces_before_it():
    source = torch.ones(NBYTES, dtype=torch.uint8)
    out = torch.zeros(NBYTES, dtype=torch.uint8)
    agent = StandInAgent()
    agent.done, agent.fail_at = 4, 2
    told: list[int] = []
    remote = {"agent": "holder", "addr": source.data_ptr(), "dev": 0, "mem": "DRAM", "gen": 1}
    with pytest.raises(SourceLostError, match="failed"):
        engine_with(agent).read(remote, 0, out, timeout=5, landing=Landing(PIECE, told.append))
    assert told == [1000, 2000]
    assert sorted(agent.released) == [0, 1, 2, 3]  # every handle let go
