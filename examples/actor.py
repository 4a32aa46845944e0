"""Actor: steps CartPole with the learner's newest policy and streams trajectories to it.

    python examples/actor.py --address 127.0.0.1:8443        # start as many as you like
"""

import argparse

import numpy as np
import torch

from rlink_ucx import Actor, Closed, PeerLost
from rlink_ucx.demo.actor import make_envs
from rlink_ucx.demo.policy import ActorCritic

parser = argparse.ArgumentParser()
parser.add_argument("--address", default="127.0.0.1:8443")
parser.add_argument("--token", default=None, help="shared secret (or set RLINK_TOKEN)")
parser.add_argument("--envs", type=int, default=4)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

T, n = 32, args.envs  # one rlink step = one env's trajectory of T steps (+ the bootstrap obs)
torch.set_num_threads(1)
envs = make_envs("CartPole-v1", n)
obs, _ = envs.reset(seed=args.seed)
model = ActorCritic(4, ("discrete", 2))
traj = {"obs": np.zeros((n, T + 1, 4), np.float32), "action": np.zeros((n, T), np.int64),
        "logp": np.zeros((n, T), np.float32), "reward": np.zeros((n, T), np.float32),
        "done": np.zeros((n, T), bool), "ep_return": np.zeros((n, T), np.float32)}  # fmt: skip
running = np.zeros(n)
with Actor(args.address, token=args.token, subscribe=True) as actor:
    print(f"actor {actor.actor_id} connected over {actor.transport} ({actor.transport_reason})")
    actor.load_remote_model(model, timeout=120)  # waits for the learner's first publish
    while True:
        try:
            actor.load_remote_model(model, latest=False)  # newest version already received: no wait
        except (PeerLost, Closed):
            break  # the learner finished (or went away)
        for t in range(T):
            traj["obs"][:, t] = obs
            action, logp = model.act(obs)
            obs, reward, terminated, truncated, _ = envs.step(action)
            done = terminated | truncated
            running += reward
            traj["action"][:, t], traj["logp"][:, t], traj["reward"][:, t], traj["done"][:, t] = action, logp, reward, done
            traj["ep_return"][:, t] = np.where(done, running, 0.0)
            running[done] = 0.0
        traj["obs"][:, T] = obs
        try:
            actor.put_many(traj)  # stamped with actor.policy_version; blocks only without credit
        except (PeerLost, Closed):
            break
