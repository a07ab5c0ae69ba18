"""`fabric hub ...`: run a hub, and show what a running hub knows."""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
from typing import Any

from rich.table import Table

from weightfabric.fabric.errors import HubError
from weightfabric.tools.command import (
    EXIT_OK,
    BadInput,
    CommandFailed,
    Console,
    add_command,
    add_group,
)

SOON_S = 0.5


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fabric hub serve`, `fabric hub relay`, `fabric hub status` and `fabric hub token`."""
    sub = add_group(
        subparsers, "hub", help="the control plane: serve a hub, show its state, issue tokens",
        description="The hub tracks which workers hold which version of which model and\n"
                    "hands readers plans; bytes never pass through it. Every request is\n"
                    "signed with the deployment secret (created by `fabric hub serve`) or a\n"
                    "token issued from it; see docs/security.md.",
        examples=["fabric hub serve --port 7470 --state-dir /var/lib/fabric-hub",
                  "fabric hub serve --store etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379",
                  "fabric hub status tcp://127.0.0.1:7470",
                  "fabric hub relay --hub tcp://10.0.0.1:7470 --port 7471",
                  "fabric hub token --role read --name rollouts > rollout.token"])

    p = add_command(sub, "serve", help="run a hub in the foreground", handler=_serve,
                    description="Run a hub until interrupted. Prints 'fabric hub serving at "
                                "URL' once bound;\nwith --port 0 the OS picks the port. "
                                "Exits 0 on SIGTERM or Ctrl-C, 1 if it\ncannot serve (e.g. "
                                "the port is taken), 2 on a bad --port, --state-dir,\n"
                                "--store, --cluster, --lease (it must be > 0) or secret file, "
                                "or an etcd\nthat does not answer.\n\n"
                                "With --store etcd://... the records live in etcd and several "
                                "hubs on it form one\nservice: the elected hub leads, the "
                                "others stand by and take over when it is\ngone (clients "
                                "list every hub's URL); see docs/operations.md.\n\n"
                                "Authentication is on: the hub loads the deployment secret "
                                "from --secret-file\n(default $WEIGHTFABRIC_SECRET_FILE, else "
                                "~/.config/weightfabric/secret),\ncreating it (mode 0600) if "
                                "missing, and prints where it is. Workers on this\nmachine "
                                "find it with no flags; copy it (or a token) to other hosts."
                                "\n\nWith --metrics-port it serves Prometheus metrics over "
                                "HTTP and prints 'metrics\nat http://HOST:PORT/metrics' (needs "
                                "pip install weightfabric[metrics]; see\ndocs/operations.md, "
                                "\"Metrics\").",
                    examples=["fabric hub serve --host 0.0.0.0 --port 7470 "
                              "--state-dir /var/lib/fabric-hub",
                              "fabric hub serve --port 7470 --metrics-port 9470",
                              "fabric hub serve --port 0 "
                              "--cluster topology/clusters/two-datacenters.yaml"])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=7470,
                   help="TCP port, 0 = any free (default 7470)")
    p.add_argument("--state-dir", help="directory keeping version numbers monotonic across "
                                       "restarts (default: none, numbers restart from the "
                                       "holders' versions)")
    p.add_argument("--store", metavar="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
                   help="keep the records in etcd (prefix default /weightfabric) and serve "
                        "as one of the hubs sharing them: one leads, the others stand by "
                        "(not with --state-dir)")
    p.add_argument("--cluster", help="cluster YAML: plan each version's broadcast on this "
                                     "topology and route readers along the plan (workers name "
                                     "their datacenter, node and device as in the file); "
                                     "default: rank sources by locality")
    p.add_argument("--routing", choices=["plan", "ranked"], default="plan",
                   help="with --cluster: 'plan' (default) routes the workers that fetched the "
                        "model before along each version's planned forest, the others by "
                        "widest path; 'ranked' ranks every reader's sources by widest path")
    p.add_argument("--plan-start-bound", type=float, default=2.0, metavar="SECONDS",
                   help="with --routing plan: how long a reader waits for its planned "
                        "upstreams to begin their fetches before it is routed around them "
                        "(default 2)")
    p.add_argument("--lease", type=_seconds, default=10.0,
                   help="seconds a worker stays alive without heartbeat (default 10)")
    p.add_argument("--heartbeat-rate", type=rate_arg, default=argparse.SUPPRESS, metavar="N|none",
                   help="heartbeats per second the workers' leases ask for at most: beyond "
                        "N x lease / 3 workers the lease grows, so the hub's idle cost stays "
                        "bounded (default 1000, HEARTBEAT_RATE in fabric/hub/state.py: "
                        "10,000 workers get 30 s; 'none': the lease as given)")
    p.add_argument("--report-budget", type=budget_arg, default=argparse.SUPPRESS,
                   metavar="N|none",
                   help="progress reports the fetches of one shard in flight are asked for "
                        "in all: each plan allows N / (fetches in flight), so a broadcast "
                        "to thousands costs the hub a bounded number of reports (default "
                        "2000, REPORT_BUDGET in fabric/hub/state_fetch.py; 'none': as many "
                        "as readers send, 2 each by default)")
    _log_level_arg(p)
    p.add_argument("--secret-file", help="the deployment secret (default: "
                                         "$WEIGHTFABRIC_SECRET_FILE, else "
                                         "~/.config/weightfabric/secret; created if missing)")
    p.add_argument("--insecure", action="store_true",
                   help="serve anyone, unauthenticated: whoever reaches the hub can publish "
                        "weights every reader loads (logged, and shown by `fabric hub status`)")
    p.add_argument("--encrypt", action="store_true",
                   help="encrypt the hub channel (zmq CURVE, keys from the secret); the URL "
                        "becomes curve://HOST:PORT, which clients then use")
    p.add_argument("--cap-ttl", type=_seconds, default=None,
                   help="seconds a read capability in a plan stays valid (default 900)")
    p.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics, 0 = "
                        "any free port (default: off; needs pip install "
                        "weightfabric[metrics])")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics are served on (default 127.0.0.1; 0.0.0.0 for "
                        "a scraper on another host)")

    p = add_command(sub, "relay", help="run a node relay in the foreground", handler=_relay,
                    description="Run a node relay until interrupted: the workers of this node "
                                "connect to it as to\nthe hub (its URL instead of the hub's) "
                                "and it forwards their requests, those\nthat answer at once "
                                "(heartbeats, plans, reports, completions) in one batch\nper "
                                "--window-ms (the next once the hub answered the last), so "
                                "the hub\nhandles one message per node where it handled one "
                                "per worker, and plans a node's\nreaders of a version "
                                "together (their begins in one request, the first\nrouted, "
                                "the others waiting on it).\n"
                                "A request signed with another credential keeps its "
                                "signature and its answer\nthe hub's; one signed with the "
                                "relay's own credential (the node's secret file\nor token) "
                                "the relay checks, vouches for, and signs the answer to. "
                                "Prints\n'fabric hub relay serving at URL' once bound. "
                                "Exits 0 on SIGTERM or Ctrl-C, 1 if it\ncannot serve, 2 on "
                                "a bad URL, port or secret file. See docs/hub.md, \"Node\n"
                                "relays\".",
                    examples=["fabric hub relay --hub tcp://10.0.0.1:7470 --port 7471",
                              "fabric hub relay --hub curve://hub:7470 --secret-file "
                              "relay.token"])
    p.add_argument("--hub", required=True, metavar="URL[,URL...]",
                   help="the hub to forward to (tcp://HOST:PORT or curve://HOST:PORT), or the "
                        "hubs of a service, comma-separated (the leader is followed)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the node's workers connect to (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=7471,
                   help="TCP port, 0 = any free (default 7471)")
    p.add_argument("--window-ms", type=float, default=None, metavar="MS",
                   help="how long a batch's first request waits for others (default 5)")
    _log_level_arg(p)
    p.add_argument("--secret-file", help="the secret or token to sign batches with (default: "
                                         "$WEIGHTFABRIC_SECRET_FILE, else "
                                         "~/.config/weightfabric/secret)")
    p.add_argument("--insecure", action="store_true", help="forward to a hub run with "
                                                           "--insecure (batches unsigned)")

    p = add_command(sub, "token", help="issue a token with scoped rights", handler=_token,
                    description="Print a token (one line) for a worker that must not hold "
                                "the deployment secret:\n'read' lets it register, fetch, serve "
                                "and derive layouts; 'publish' adds\npublishing the --model "
                                "patterns; 'admin' adds retention, pins and others'\nkv keys. "
                                "Give it to the worker as a file (secret_file=, or\n"
                                "WEIGHTFABRIC_SECRET_FILE). Needs the deployment secret; "
                                "the hub keeps no\nlist of tokens: rotate the secret to "
                                "revoke them all. Exits 2 on bad input.",
                    examples=["fabric hub token --role read --name rollouts > rollout.token",
                              "fabric hub token --role publish --model 'policy*' "
                              "--name trainer --ttl 86400"])
    p.add_argument("--role", action="append", choices=["read", "publish", "admin"],
                   required=True, help="a right to grant (repeat for several)")
    p.add_argument("--model", action="append", default=None,
                   help="a model name pattern 'publish' covers (fnmatch; repeat; default *)")
    p.add_argument("--name", required=True, help="who the token is for (shown in the "
                                                  "hub's log and errors)")
    p.add_argument("--ttl", type=_seconds, default=None,
                   help="seconds until it expires (default: never)")
    p.add_argument("--secret-file", help="the deployment secret (default as `fabric hub serve`)")

    p = add_command(sub, "status", help="show a hub's models, versions, fetches and leases",
                    handler=_status,
                    description="Models, versions with state and replica counts "
                                "(full/partial), fetches in\nflight with progress, and "
                                "worker leases, soonest to expire first; for hubs over etcd, "
                                "the hubs\n(leader first) and the etcd members with their "
                                "health. Long names\n"
                                "wrap inside their column, whole. Exits 1 if no hub "
                                "answers at URL within\n--timeout, 2 on a malformed URL.",
                    examples=["fabric hub status tcp://127.0.0.1:7470",
                              "fabric hub status tcp://hub:7470 --json | jq .models",
                              "fabric hub status tcp://hub-a:7470,tcp://hub-b:7470"])
    p.add_argument("url", help="hub URL, e.g. tcp://127.0.0.1:7470; the hubs of a service "
                               "comma-separated (the leader answers)")
    p.add_argument("--json", action="store_true", help="print the raw snapshot as JSON")
    p.add_argument("--timeout", type=_seconds, default=5.0,
                   help="seconds to wait for the hub's answer (default 5)")
    p.add_argument("--secret-file", help="the secret or token to sign with (default: "
                                         "$WEIGHTFABRIC_SECRET_FILE, else "
                                         "~/.config/weightfabric/secret)")
    p.add_argument("--insecure", action="store_true", help="talk to a hub run with --insecure")


def _log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level (default INFO)")


def _log_to_stderr(args: argparse.Namespace) -> None:
    """Log at ``--log-level`` to stderr (a server's foreground log)."""
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")


def _port(text: str) -> int:
    """A TCP port for argparse (zmq would silently bind ``port % 65536``)."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return int(text)


def _positive(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _seconds(text: str) -> float:
    """A positive, finite number of seconds for argparse."""
    return _positive(text, "a positive, finite number of seconds")


def budget_arg(text: str) -> int | None:
    """``none`` or a number >= 0, for argparse (``--report-budget``)."""
    if text.lower() == "none":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0 or 'none'")
    return int(text)


def rate_arg(text: str) -> float | None:
    """``none`` or a positive, finite number, for argparse (``--heartbeat-rate``)."""
    return None if text.lower() == "none" else _positive(text, "a positive number or 'none'")


def _serve(args: argparse.Namespace) -> int:
    from weightfabric.fabric.hub.planned import PlanRouter, plan_router
    from weightfabric.fabric.hub.server import HubServer
    from weightfabric.fabric.locality import RankSources

    _log_to_stderr(args)
    try:
        rank_sources: RankSources | None = None    # HubServer's default: by locality
        routing: PlanRouter | None = None
        if args.cluster and args.routing == "plan":
            routing = plan_router(args.cluster, start_bound_s=args.plan_start_bound)
        elif args.cluster:
            from weightfabric.fabric.hub.ranking import topology_ranker

            rank_sources = topology_ranker(args.cluster)
        extra: dict[str, Any] = {} if args.cap_ttl is None else {"cap_ttl_s": args.cap_ttl}
        for given in ("report_budget", "heartbeat_rate"):   # else the hub's defaults
            if given in vars(args):
                extra[given] = vars(args)[given]
        if args.metrics_port is not None:
            extra.update(metrics_port=args.metrics_port, metrics_host=args.metrics_host)
        scheme = "curve" if args.encrypt else "tcp"
        if args.encrypt and args.insecure:
            raise BadInput("--encrypt needs authentication: drop --insecure")
        server = HubServer(f"{scheme}://{args.host}:{args.port}", state_dir=args.state_dir,
                           store=args.store, lease_s=args.lease, rank_sources=rank_sources,
                           plan_routing=routing,
                           secret_file=args.secret_file, insecure=args.insecure, **extra)
    except (ValueError, HubError) as exc:
        raise BadInput(exc) from exc
    except ImportError as exc:   # --metrics-port without prometheus-client
        raise CommandFailed(exc) from exc
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0))

    def ready(url: str) -> None:
        print(f"fabric hub serving at {url}", flush=True)
        print(f"authentication: {server.auth_mode}", flush=True)
        if server.metrics_url:
            print(f"metrics at {server.metrics_url}", flush=True)
    try:
        server.serve_forever(ready)
    except KeyboardInterrupt:
        server.stop(0)
    except Exception as exc:
        raise CommandFailed(f"cannot serve on {args.host}:{args.port}: {exc}") from exc
    return EXIT_OK


def _relay(args: argparse.Namespace) -> int:
    from weightfabric.fabric.relay import WINDOW_S, NodeRelay

    _log_to_stderr(args)
    window = WINDOW_S if args.window_ms is None else args.window_ms / 1e3
    try:
        relay = NodeRelay(args.hub, f"tcp://{args.host}:{args.port}", window_s=window,
                          secret_file=args.secret_file, insecure=args.insecure)
    except (ValueError, HubError) as exc:
        raise BadInput(exc) from exc
    signal.signal(signal.SIGTERM, lambda *_: relay.stop(0))
    try:
        relay.serve_forever(lambda url: print(f"fabric hub relay serving at {url}", flush=True))
    except KeyboardInterrupt:
        relay.stop(0)
    except Exception as exc:
        raise CommandFailed(f"cannot relay on {args.host}:{args.port}: {exc}") from exc
    return EXIT_OK


def _token(args: argparse.Namespace) -> int:
    from weightfabric.fabric.auth import Authority

    try:
        token = Authority(args.secret_file).issue_token(args.name, args.role, args.model,
                                                        args.ttl)
    except (ValueError, HubError) as exc:
        raise BadInput(exc) from exc
    print(token)
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from weightfabric.fabric.client import connect
    from weightfabric.fabric.zmq_util import endpoint

    try:
        for url in args.url.split(","):
            endpoint(url.strip(), bind=False)
    except HubError as exc:  # not a hub URL: bad input, not a hub that failed to answer
        raise BadInput(exc) from exc
    try:
        with connect(args.url, timeout=args.timeout, secret_file=args.secret_file,
                     insecure=args.insecure) as client:
            snap = client.status()
    except HubError as exc:
        raise CommandFailed(exc) from exc
    if args.json:
        print(json.dumps(snap, indent=2))
        return EXIT_OK
    render_status(snap, Console())
    return EXIT_OK


def _table(*headers: str, title: str) -> Table:
    """A table whose cells wrap long values inside their column, whole.

    A model or worker name is an identifier, never cut or ellipsized to fit the
    terminal.
    """
    table = Table(*headers, title=title)
    for column in table.columns:
        column.overflow = "fold"
    return table


def render_status(snap: dict, console: Console) -> None:
    """Print a hub snapshot as rich tables (long names wrap, whole)."""
    lease, asked = snap["lease_s"], snap.get("lease_asked_s", snap["lease_s"])
    why = (f" ({asked:g} s asked; longer so that its workers heartbeat at most "
           f"{snap.get('heartbeat_rate') or 0:g} times a second in all)" if lease > asked else "")
    console.print(f"[bold]hub[/]: {len(snap['models'])} models, {len(snap['workers'])} workers, "
                  f"{len(snap['fetches'])} fetches in flight, lease {lease:g} s{why}")
    auth = snap.get("auth", "")
    if auth:
        style = "bold red" if auth.startswith("OFF") else "green"
        console.print(f"[bold]authentication[/]: [{style}]{auth}[/]")
    service = snap.get("service") or {}
    if service.get("role") in ("leader", "standby"):
        console.print(f"[bold]service[/]: this hub {service['url']} is the "
                      f"[bold]{service['role']}[/] (led {service['terms']} terms); records in "
                      f"{service['store']}")
        console.print("[bold]hubs[/]: " + (", ".join(
            f"{u} (leader)" if i == 0 else u for i, u in enumerate(service["hubs"]))
            or "none seen (etcd silent?)"))
        etcd = _table("etcd member", "endpoint", "health", title="etcd")
        for m in service["etcd"]:
            health = ("[green]healthy[/]" + (" (etcd leader)" if m.get("leader") else "")
                      if m["healthy"] else f"[red]down[/] {m.get('error') or ''}")
            etcd.add_row(m["name"], m["endpoint"], health)
        console.print(etcd)
    versions = _table("model", "ver", "state", "shards", "full", "part", "retr", "kept", "note",
                      title="versions (* = latest; full/partial/retracting replicas)")
    for name, m in snap["models"].items():
        for v in m["versions"]:
            mark = "*" if v["version"] == m["latest"] else ""
            versions.add_row(name, f"{v['version']}{mark}", v["state"], str(v["num_shards"]),
                             str(v["full"]), str(v["partial"]), str(v["retracting"]),
                             "pinned" if v["pinned"] else ("yes" if v["retained"] else "no"),
                             v["reason"])
        for r in m.get("retired", []):        # retired and no longer held by anyone
            versions.add_row(name, str(r["version"]), "retired", "", "0", "0", "0", "no",
                             r["reason"])
        if not m["versions"] and not m.get("retired"):
            versions.add_row(name, "-", "-", "", "", "", "", "", "no versions held")
    console.print(versions)
    if snap["fetches"]:
        fetches = _table("fetch", "worker", "model", "ver", "shard", "progress", "sources",
                         title="fetches in flight")
        for f in snap["fetches"]:
            pct = 100 * f["have"] / max(1, f["num_chunks"])
            fetches.add_row(f["fetch_id"], f["worker"], f["model"], str(f["version"]),
                            str(f["shard"]), f"{f['have']}/{f['num_chunks']} ({pct:.0f}%)",
                            ", ".join(f["sources"]))
        console.print(fetches)
    if snap.get("recent_fetches"):
        recent = _table("worker", "model", "ver", "shard", "delivered MB", "wire MB", "wire/delivered",
                        "from (delivered/wire MB)", title="recent fetches (deltas: fewer wire bytes)")
        for f in snap["recent_fetches"]:
            froms = ", ".join(f"{w} {d / 1e6:.1f}/{n / 1e6:.1f}" for w, (d, n) in f["sources"].items())
            recent.add_row(f["worker"], f["model"], str(f["version"]), str(f["shard"]),
                           f"{f['delivered'] / 1e6:.1f}", f"{f['wire'] / 1e6:.1f}",
                           f"{f['wire'] / max(1, f['delivered']):.3f}", froms)
        console.print(recent)
    if snap.get("plans"):
        plans = _table("model", "ver", "shard", "sources", "planned readers", "predicted s",
                       "routed around", title="broadcast plans (routing: plan)")
        for p in snap["plans"]:
            plans.add_row(p["model"], str(p["version"]), str(p["shard"]), ", ".join(p["sources"]),
                          str(p["readers"]), f"{p['predicted_s']:.3f}",
                          ", ".join(p["routed_around"]) or "-")
        console.print(plans)
    workers = _table("worker", "datacenter", "node", "device", "lease left", title="leases")
    for w in snap["workers"]:
        left = w["expires_in"]
        style = "red" if left < SOON_S * lease else ""
        loc = w["location"]
        workers.add_row(w["worker"], loc["datacenter"], loc["node"], loc["device"],
                        f"[{style}]{left:.1f} s[/]" if style else f"{left:.1f} s")
    console.print(workers)
