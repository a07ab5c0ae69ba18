"""Plan-driven routing: the hub runs the planner's broadcast forest over a cluster YAML.

Run it:  python examples/planned_broadcast.py
It starts a hub with a cluster of two datacenters (a trainer and four rollout nodes), and
one process per node on this machine, each claiming its node's location and its own host
id (so they read each other over TCP, as across machines). In a real cluster, run
`fabric hub serve --cluster cluster.yaml` once and start each worker on its node with that
node in `location`.

Version 1 is routed by ranking (nobody has fetched the model yet); from version 2 on, the
hub plans each version and every rollout reads each stripe from its parent in the plan:
one rollout of dc-b reads from dc-a, the others from it.
"""

import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path

import torch

import weightfabric as wf
from weightfabric.fabric.hub.planned import plan_router

CLUSTER = """
version: 1
name: example
node_types:
  box:
    gpus: 0
    nics: {count: 2, bandwidth: 100Gbps, kind: rdma}
datacenters:
  - name: dc-a
    nodes:
      - {name: trainer, type: box}
      - {name: a-0, type: box}
  - name: dc-b
    nodes:
      - {name: "b-{i}", type: box, count: 3}
wan:
  - {between: [dc-a, dc-b], bandwidth: 25Gbps, latency: 20ms}
roles:
  trainer: [trainer]
  rollout: ["a-*", "b-*"]
"""
NODES = {"trainer": "dc-a", "a-0": "dc-a", "b-0": "dc-b", "b-1": "dc-b", "b-2": "dc-b"}
VERSIONS = 3


def weights(step: int) -> dict[str, torch.Tensor]:
    """The policy's weights at a training step (16 MB)."""
    g = torch.Generator().manual_seed(step)
    return {f"layer{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(4)}


def worker(url: str, node: str, todo: mp.Queue, done: mp.Queue) -> None:
    """The trainer publishes what `todo` says; a rollout fetches it and says from whom."""
    os.environ["WEIGHTFABRIC_HOST_ID"] = node  # another machine: reads cross the network
    location = {"datacenter": NODES[node], "node": node, "device": "host"}
    with wf.join(url, worker=node, location=location) as w:
        store = w.model("policy", chunk_size=1 << 20)
        while (job := todo.get(timeout=120)) is not None:
            version, step = job
            if node == "trainer":
                done.put(store.publish(weights(step)))
            else:
                stats = store.fetch(version)
                exact = all(torch.equal(store.tensors[k], t) for k, t in weights(step).items())
                done.put((node, {s: round(n / 1e6, 1) for s, n in stats.sources.items()}, exact))


def main() -> int:
    """Hub, trainer and rollouts; three versions; 0 when every fetch was bit-exact."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Path(tmp) / "cluster.yaml"
        cluster.write_text(CLUSTER)
        router = plan_router(cluster)
        hub = wf.serve("tcp://127.0.0.1:0", plan_routing=router)
        ctx = mp.get_context("spawn")
        queues = {n: ctx.Queue() for n in NODES}
        done = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(hub.url, n, queues[n], done)) for n in NODES]
        for p in procs:
            p.start()
        ok = True
        try:
            for step in range(1, VERSIONS + 1):
                queues["trainer"].put((None, step))
                version = done.get(timeout=120)
                for n in NODES:
                    if n != "trainer":
                        queues[n].put((version, step))
                print(f"v{version}:")
                for _ in range(len(NODES) - 1):
                    node, sources, exact = done.get(timeout=120)
                    ok &= exact
                    print(f"  {node} ({NODES[node]}) read MB from {sources}"
                          f"{'' if exact else '  NOT BIT-EXACT'}")
            for plan in router.summary():
                print(f"plan of v{plan['version']}: {plan['readers']} readers, predicted "
                      f"{plan['predicted_s'] * 1e3:.1f} ms on the cluster's links, routed "
                      f"around: {plan['routed_around'] or 'none'}")
        finally:
            for q in queues.values():
                q.put(None)
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
            hub.stop()
    return 0 if ok and all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
