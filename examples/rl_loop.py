"""The smallest weightfabric integration: a trainer publishes, a rollout fetches, each step.

Run it:  python examples/rl_loop.py
It starts its own hub; in a cluster, run `fabric hub serve` once and give `trainer`
and `rollout` the URL it prints.
Copy `trainer` into your training loop and `rollout` into your inference workers.
"""

import multiprocessing as mp
import sys
from multiprocessing.synchronize import Event

import torch
from torch import nn

import weightfabric as wf

STEPS = 3


def make_policy() -> nn.Module:
    """A small policy network, seeded so every process builds the same one."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 16))


def trainer(url: str, samples: mp.Queue, done: Event) -> None:
    """Train the policy on the rollout's samples, publishing each version."""
    policy = make_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    with wf.join(url, worker="trainer") as worker:
        store = worker.model("policy")
        for _ in range(STEPS):
            version = store.publish(policy)  # a snapshot: training may go on at once
            obs, actions, rewards = map(torch.from_numpy, samples.get(timeout=120))
            logp = torch.log_softmax(policy(obs), -1).gather(1, actions[:, None]).squeeze(1)
            loss = -((rewards - rewards.mean()) * logp).mean()  # REINFORCE
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"trainer: published v{version}, then trained on its samples "
                  f"(reward {rewards.mean():.2f})", flush=True)
        # end so the last version outlives this process: it lives while a live worker holds it
        store.wait_replicated(version, replicas=1, timeout=120)


def rollout(url: str, samples: mp.Queue, done: Event) -> None:
    """Sync to each newer policy, roll it out and send the samples to the trainer."""
    policy = make_policy()  # whatever weights: every fetch overwrites them
    with wf.join(url, worker="rollout-0") as worker:
        store = worker.model("policy")
        store.attach(policy)  # parameters move into shared memory, once
        for _ in range(STEPS):
            stats = store.sync(timeout=120)  # waits for a newer version, lands in the parameters
            version = stats.version
            obs = torch.randn(32, 64)
            with torch.no_grad():
                actions = torch.distributions.Categorical(logits=policy(obs)).sample()
            rewards = (actions % 2 == 0).float()  # a toy reward
            samples.put((obs.numpy(), actions.numpy(), rewards.numpy()))  # by value
            print(f"rollout: v{version}: {stats.bytes / 1e3:.0f} kB in "
                  f"{stats.seconds * 1e3:.1f} ms from {', '.join(stats.sources)}", flush=True)
        done.wait(timeout=120)  # serve the last version until the trainer has ended


if __name__ == "__main__":
    hub = wf.serve("tcp://127.0.0.1:0")
    ctx = mp.get_context("spawn")
    samples, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=role, args=(hub.url, samples, done)) for role in (trainer, rollout)]
    for p in procs:
        p.start()
    for p in procs:  # the trainer first
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
        done.set()
    hub.stop()
    sys.exit(max(1 if p.exitcode is None else abs(p.exitcode) for p in procs))
