"""Two hubs over a real 3-member etcd, all as processes: failover mid-fetch, etcd failures.

One test walks the whole story on one cluster (the processes take seconds to start):
the leading hub is SIGKILLed while 4 readers fetch; every fetch finishes bit-exact, the
next versions publish through the other hub, and `fabric hub status` shows the change;
then one etcd member is killed (nothing changes for the workers), then a majority is
stopped (writes are refused with a typed error) and brought back (nothing lost).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from hub_helpers import kill_all
from paths import ROOT, child_env
from procs import Proc, children
from test_hub_tcp import read_line
from timeouts import hard_timeout

import weightfabric as wf
from weightfabric.tools.etcd_cluster import EtcdCluster

MB = 32
LEASE = 5.0


def start_hub(procs: list, store: str) -> str:
    cmd = [sys.executable, "-m", "weightfabric.tools", "hub", "serve", "--port", "0",
           "--store", store, "--lease", str(LEASE), "--log-level", "WARNING"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    procs.append(p)
    line = read_line(p, 30)
    assert line.startswith("fabric hub serving at "), line
    return line.split()[-1]


def service_status(urls: str) -> dict:
    with wf.connect(urls, timeout=5) as observer:
        return observer.status()["service"]


def wait_for_leader(urls: str, timeout: float = 15.0, not_: str | None = None) -> str:
    deadline = time.monotonic() + timeout
    while True:
        for url in urls.split(","):
            try:
                with wf.connect(url, timeout=2) as observer:
                    service = observer.status()["service"]
            except wf.HubError:
                continue
            if service["role"] == "leader" and url != not_:
                return url
        assert time.monotonic() < deadline, f"no hub of {urls} leads within {timeout} s"
        time.sleep(0.1)


def fetch_progress(urls: str, worker: str) -> int:
    with wf.connect(urls, timeout=5) as observer:
        return sum(f["have"] for f in observer.status()["fetches"] if f["worker"] == worker)


def publish_and_fetch(trainer, readers, seed: int) -> int:
    version = trainer.ask("publish", seed=seed, mb=MB)["version"]
    for r in readers:
        r.ask("expect", seed=seed, mb=MB)
        r.send("fetch", version=version)
    stats = [r.reply() for r in readers]
    assert all(s["exact"] for s in stats), stats
    return version


def test_leader_killed_mid_fetch_then_etcd_members_lost_and_back(tmp_path) -> None:
    hubs: list[subprocess.Popen] = []
    with hard_timeout(240), EtcdCluster(3, base_dir=tmp_path) as etcd:
        try:
            store = f"{etcd.url}/test-service"
            urls = [start_hub(hubs, store) for _ in range(2)]
            service = ",".join(urls)
            leader = wait_for_leader(service)
            other = next(u for u in urls if u != leader)

            def make(name: str, **kw):
                return Proc(service, name, fork=True, **kw)

            with children(200, make) as spawn:
                trainer = spawn("trainer")
                readers = [spawn(f"reader-{i}", read_delay=0.3) for i in range(4)]
                v1 = trainer.ask("publish", seed=1, mb=MB)["version"]
                for r in readers:
                    r.ask("expect", seed=1, mb=MB)
                    r.send("fetch", version=v1)
                deadline = time.monotonic() + 60
                while fetch_progress(service, "reader-0") < 1:
                    assert time.monotonic() < deadline, "the readers made no progress"
                    time.sleep(0.05)

                # The leader's machine is gone, fetches in flight.
                hubs[urls.index(leader)].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                assert wait_for_leader(other, not_=leader) == other
                took = time.monotonic() - killed
                assert took < 5.0, f"the standby took {took:.1f} s to lead"
                stats = [r.reply() for r in readers]
                assert all(s["exact"] for s in stats), stats

                v2 = publish_and_fetch(trainer, readers, seed=2)
                v3 = publish_and_fetch(trainer, readers, seed=3)
                assert (v2, v3) == (v1 + 1, v1 + 2)   # numbers neither reused nor skipped
                cli = subprocess.run(
                    [sys.executable, "-m", "weightfabric.tools", "hub", "status", service,
                     "--json"], capture_output=True, text=True, env=child_env(), cwd=ROOT,
                    timeout=30, check=True)
                shown = json.loads(cli.stdout)["service"]
                assert shown["leader"] == other and shown["role"] == "leader", shown

                # One etcd member lost: nothing changes for the workers.
                etcd.kill(0)
                v4 = publish_and_fetch(trainer, readers, seed=4)
                assert v4 == v3 + 1

                # A majority lost: writes refused with a typed error, nothing half-done.
                with wf.connect(service, timeout=10) as admin:
                    admin.set_retention("bench", keep_last=4)
                    kept = 4           # the last write taken: it must be there afterwards
                    etcd.stop_member(1)
                    deadline = time.monotonic() + 15
                    while True:
                        try:
                            admin.set_retention("bench", keep_last=9 - kept)
                            kept = 9 - kept   # taken before the quorum was gone
                        except (wf.StoreUnavailableError, wf.NotLeaderError) as exc:
                            refused = exc
                            break
                        assert time.monotonic() < deadline, "writes still taken w/o quorum"
                        time.sleep(0.2)
                assert isinstance(refused, wf.StoreUnavailableError | wf.NotLeaderError)
                trainer.send("publish", seed=5, mb=MB)
                failed = trainer.next_reply(60)
                assert failed.get("error") in (
                    "StoreUnavailableError", "NotLeaderError", "HubTimeoutError"), failed

                # Back: a leader again, every record there, numbers go on.
                etcd.restart(0)
                etcd.restart(1)
                wait_for_leader(service, timeout=30)
                v6 = publish_and_fetch(trainer, readers, seed=6)
                assert v6 > v4
                with wf.connect(service, timeout=10) as observer:
                    snap = observer.status()
                    assert observer.latest("bench") == v6
                model = snap["models"]["bench"]
                assert v6 in [v["version"] for v in model["versions"]]
                # a write taken is kept; the refused one may have reached etcd or not (a
                # write that timed out), never anything else
                assert model["policy"]["keep_last"] in (kept, 9 - kept)
                assert model["next_version"] == v6 + 1
        finally:
            kill_all(hubs)
    assert not [p for p in hubs if p.poll() is None]

