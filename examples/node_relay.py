"""A node's rollouts reach the hub through a node relay: their requests go in batches.

Run it:  python examples/node_relay.py
It serves a hub and a node relay in this process (in a cluster: `fabric hub serve` on
the hub's host, `fabric hub relay --hub URL` on each rollout node), a trainer that
publishes straight to the hub, and four rollouts of one node that connect to the relay
instead. Their heartbeats, plans and completions reach the hub in batches; the hub
plans the node's readers of a version together (the first from the trainer, the others
waiting on it). Authenticated with the deployment secret (`fabric hub serve` creates
it), which the relay and the rollouts share: the relay checks each rollout's signature
and vouches for its request (the hub checks one signature per batch, the relay signs
the answers), and the node's begins of a version go as one request.
"""

import concurrent.futures

import torch

import weightfabric as wf
from weightfabric.fabric.relay import NodeRelay

NODE = {"datacenter": "dc0", "node": "node-7"}


def main() -> None:
    """Publish two versions; four rollouts of one node fetch each through the relay."""
    with wf.serve("tcp://127.0.0.1:0") as hub, NodeRelay(hub.url) as relay:
        print(f"hub {hub.url}; node relay {relay.url}")
        weights = {"w": torch.randn(512, 512), "b": torch.zeros(512)}
        rollouts = [wf.join(relay.url, worker=f"rollout-{i}", location=NODE)
                    for i in range(4)]
        try:
            with wf.join(hub.url, worker="trainer",
                         location={"datacenter": "dc0", "node": "trainer"}) as trainer:
                publisher = trainer.model("policy")
                stores = []
                for r in rollouts:
                    store = r.model("policy")
                    store.attach({k: torch.empty_like(v) for k, v in weights.items()})
                    stores.append(store)
                for step in range(2):
                    weights["b"] += 1
                    version = publisher.publish(weights)
                    with concurrent.futures.ThreadPoolExecutor(len(stores)) as pool:
                        got = list(pool.map(lambda s, v=version: s.fetch(v), stores))
                    exact = all(torch.equal(s.tensors[k], weights[k])
                                for s in stores for k in weights)
                    print(f"step {step}: v{version} fetched by {len(got)} rollouts, "
                          f"bit-exact: {exact}")
                    assert exact
        finally:
            for r in rollouts:
                r.close()
        s = relay.stats
        print(f"relay: {s.batched} requests in {s.batches} batches ({s.vouched} vouched for, "
              f"{s.joined} begins joined), {s.alone} alone; the hub answered "
              f"{hub.num_batches} batches")


if __name__ == "__main__":
    main()
