"""On-policy PPO actor: one CartPole env; for each model version, one rollout of T steps, sent
with its bootstrap observation as one rlink step (docs/on-policy.md walks through it).

    python examples/ppo_onpolicy_actor.py --address 127.0.0.1:8443

It may start before the learner (it waits for it) and exits, with one line saying why, once the
learner finishes.
"""

import argparse
import sys

import gymnasium as gym
import numpy as np
import torch

from rlink_ucx import Actor, Closed, RLinkError, read_token_file
from rlink_ucx.demo.policy import ActorCritic

parser = argparse.ArgumentParser()
parser.add_argument("--address", default="127.0.0.1:8443", help="the learner's host:port")
parser.add_argument("--token-file", default=None, help="file holding the shared secret (or set RLINK_TOKEN_FILE)")
parser.add_argument("--steps", type=int, default=128, help="env steps per rollout (T)")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
T = args.steps


def run() -> None:
    torch.set_num_threads(1)
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=args.seed)
    model = ActorCritic(4, ("discrete", 2))
    # One rollout = one rlink step: obs has T + 1 rows, the last the bootstrap observation
    # (the value of where the rollout stopped), the other fields T.
    rollout = {"obs": np.zeros((T + 1, 4), np.float32), "action": np.zeros(T, np.int64),
               "logp": np.zeros(T, np.float32), "reward": np.zeros(T, np.float32),
               "done": np.zeros(T, bool), "ep_return": np.zeros(T, np.float32)}  # fmt: skip
    episode_return = 0.0
    token = read_token_file(args.token_file) if args.token_file else None  # never on argv: `ps` shows it
    with Actor(args.address, token=token, subscribe=True) as actor:
        print(f"actor {actor.actor_id} connected over {actor.transport}", flush=True)
        version = actor.load_remote_model(model, timeout=300)  # the learner's first version
        while True:
            for t in range(T):
                rollout["obs"][t] = obs
                action, logp = model.act(obs)
                obs, reward, terminated, truncated, _ = env.step(int(action))
                done = terminated or truncated
                episode_return += float(reward)
                rollout["action"][t], rollout["logp"][t], rollout["reward"][t] = action, logp, reward
                rollout["done"][t], rollout["ep_return"][t] = done, episode_return if done else 0.0
                if done:
                    obs, _ = env.reset()
                    episode_return = 0.0
            rollout["obs"][T] = obs  # the bootstrap observation
            actor.put(rollout, version=version)  # the version that acted, whatever comes meanwhile
            # Block until the learner has trained on this rollout and published: no polling.
            version = actor.load_remote_model(model, newer_than=version, timeout=600)


try:
    run()
except Closed as exc:  # the learner finished and said so
    print(f"actor exiting: {exc}", flush=True)
except RLinkError as exc:  # unreachable, refused, or lost for longer than Config.reconnect_timeout
    print(f"actor stopped: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(1)
