"""DQN with prioritized replay on CartPole, through rlink's ReplayDataset.

Actor processes play CartPole with an epsilon-greedy copy of the Q-network (loaded with
``load_remote_model``), compute each step's initial priority from their own TD error (as in
Ape-X) and ``put`` it with the step. The learner samples prioritized batches, weights the loss
with ``batch.weight``, hands the new TD errors back with ``update_priorities`` and publishes
the network every few updates. The rate limiter (``samples_per_insert``) keeps the updates per
environment step fixed however fast the actors and the learner run.

    python examples/dqn_replay.py --actors 1 --target 195
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

import numpy as np

GAMMA = 0.99


def q_network() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(4, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 2))  # fmt: skip


def run_actor(address: str, seed: int, stop: Any, eps_steps: int) -> None:
    """Play until ``stop`` is set, putting (obs, action, reward, next_obs, done) with a priority."""
    import gymnasium as gym
    import torch

    from rlink_ucx import Actor, Closed

    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    net = q_network()
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=seed)
    steps = 0
    with Actor(address, subscribe=True) as actor:
        actor.load_remote_model(net, timeout=120)
        try:
            while not stop.is_set():
                actor.load_remote_model(net, latest=False)  # the newest version already here: no wait
                eps = max(0.02, 1.0 - steps / eps_steps)
                with torch.no_grad():
                    q = net(torch.from_numpy(obs).float().unsqueeze(0))[0].numpy()
                action = int(rng.integers(2)) if rng.random() < eps else int(q.argmax())
                next_obs, reward, terminated, truncated, _ = env.step(action)
                with torch.no_grad():
                    q_next = net(torch.from_numpy(next_obs).float().unsqueeze(0))[0].numpy()
                td = reward + GAMMA * (1.0 - terminated) * q_next.max() - q[action]
                actor.put({"obs": obs.astype(np.float32), "action": np.int64(action), "reward": np.float32(reward),
                           "next_obs": next_obs.astype(np.float32), "done": np.float32(terminated)},
                          priority=abs(float(td)) + 1e-3)  # fmt: skip
                steps += 1
                obs = next_obs
                if terminated or truncated:
                    obs, _ = env.reset()
        except Closed:
            pass  # the learner finished first
    env.close()


def evaluate(net: Any, episodes: int, seed: int) -> float:
    """Mean return of the greedy policy over ``episodes`` episodes."""
    import gymnasium as gym
    import torch

    env = gym.make("CartPole-v1")
    total = 0.0
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        done = False
        while not done:
            with torch.no_grad():
                action = int(net(torch.from_numpy(obs).float().unsqueeze(0)).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total += reward
            done = terminated or truncated
    env.close()
    return total / episodes


def train(actors: int = 1, target: float = 195.0, max_updates: int = 40_000, max_seconds: float = 600.0,
          seed: int = 0, log: bool = True) -> dict[str, Any]:  # fmt: skip
    import torch

    from rlink_ucx import Learner, ReplayDataset

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    net, target_net = q_network(), q_network()
    target_net.load_state_dict(net.state_dict())
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    started = time.monotonic()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    best, updates = 0.0, 0
    with Learner("127.0.0.1:0") as learner:
        # 64 samples per insert with batches of 64: one update per environment step.
        replay = ReplayDataset(learner, capacity=50_000, batch_size=64, sampler="prioritized",
                               priority_exponent=0.6, importance_exponent=0.4, samples_per_insert=64,
                               min_size=1000, seed=seed)  # fmt: skip
        learner.publish(net)
        procs = [ctx.Process(target=run_actor, args=(learner.address, seed + 1 + i, stop, 6000)) for i in range(actors)]
        for p in procs:
            p.start()
        try:
            while updates < max_updates and time.monotonic() - started < max_seconds:
                b = replay.sample(timeout=120)
                obs, action, reward = b["obs"], b["action"], b["reward"]
                q = net(obs).gather(1, action.unsqueeze(1)).squeeze(1)
                with torch.no_grad():  # double DQN target
                    next_action = net(b["next_obs"]).argmax(1, keepdim=True)
                    next_q = target_net(b["next_obs"]).gather(1, next_action).squeeze(1)
                    goal = reward + GAMMA * (1.0 - b["done"]) * next_q
                td = goal - q
                loss = (b.weight * torch.nn.functional.smooth_l1_loss(q, goal, reduction="none")).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                replay.update_priorities(b.index, td.detach().abs() + 1e-3)
                updates += 1
                if updates % 500 == 0:
                    target_net.load_state_dict(net.state_dict())
                if updates % 50 == 0:
                    learner.publish(net)
                if updates % 500 == 0 and evaluate(net, 5, seed=1000 + updates) >= target:
                    # A quick look said yes: confirm over 20 fresh episodes before stopping.
                    score = evaluate(net, 20, seed=100_000 + updates)
                    best = max(best, score)
                    if log:
                        print(f"updates {updates:6d}  env steps {replay.inserted:6d}  "
                              f"greedy return over 20 episodes {score:6.1f}  {time.monotonic() - started:5.1f}s", flush=True)  # fmt: skip
                    if score >= target:
                        break
                elif log and updates % 2000 == 0:
                    print(f"updates {updates:6d}  env steps {replay.inserted:6d}  {time.monotonic() - started:5.1f}s")
        finally:
            stop.set()
            env_steps = replay.inserted
            replay.close()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return {"mean_return": best, "updates": updates, "env_steps": env_steps,
            "seconds": round(time.monotonic() - started, 1), "solved": best >= target}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--target", type=float, default=195.0, help="stop once the greedy mean return reaches this")
    parser.add_argument("--max-updates", type=int, default=40_000)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = train(args.actors, args.target, args.max_updates, args.max_seconds, args.seed, log=not args.json)
    print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
