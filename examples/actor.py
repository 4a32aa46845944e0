"""Actor: steps CartPole with the learner's newest policy and streams trajectories to it.

    python examples/actor.py --address 127.0.0.1:8443        # start as many as you like
    python examples/actor.py --address learner-host:8443 --token-file ~/.rlink-token   # across hosts

It may start before the learner (it waits for it) and exits on its own, with one line saying
why, once the learner finishes.
"""

import argparse
import logging
import sys

import numpy as np
import torch

from rlink_ucx import Actor, Closed, RLinkError, read_token_file
from rlink_ucx.demo.actor import make_envs
from rlink_ucx.demo.policy import ActorCritic

parser = argparse.ArgumentParser()
parser.add_argument("--address", default="127.0.0.1:8443", help="the learner's host:port")
parser.add_argument("--token-file", default=None, help="file holding the shared secret, mode 0600 (or set RLINK_TOKEN_FILE)")
parser.add_argument("--envs", type=int, default=4, help="environments stepped together")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING, format="%(message)s")  # e.g. "waiting for the learner at ..."
T = 32  # one rlink step = one env's trajectory of T steps (+ the bootstrap obs)


def run() -> None:
    """Step the envs and stream trajectories until the learner finishes (raises Closed)."""
    n = args.envs
    torch.set_num_threads(1)
    envs = make_envs("CartPole-v1", n)
    obs, _ = envs.reset(seed=args.seed)
    model = ActorCritic(4, ("discrete", 2))
    traj = {"obs": np.zeros((n, T + 1, 4), np.float32), "action": np.zeros((n, T), np.int64),
            "logp": np.zeros((n, T), np.float32), "reward": np.zeros((n, T), np.float32),
            "done": np.zeros((n, T), bool), "ep_return": np.zeros((n, T), np.float32)}  # fmt: skip
    running = np.zeros(n)
    token = read_token_file(args.token_file) if args.token_file else None  # never on argv: `ps` shows it
    with Actor(args.address, token=token, subscribe=True) as actor:
        print(f"actor {actor.actor_id} connected over {actor.transport} ({actor.transport_reason})")
        actor.load_remote_model(model, timeout=120)  # waits for the learner's first publish
        while True:
            actor.load_remote_model(model, latest=False)  # newest version already received: no wait
            for t in range(T):
                traj["obs"][:, t] = obs
                action, logp = model.act(obs)
                obs, reward, terminated, truncated, _ = envs.step(action)
                done = terminated | truncated
                running += reward
                traj["action"][:, t], traj["logp"][:, t], traj["reward"][:, t] = action, logp, reward
                traj["done"][:, t] = done
                traj["ep_return"][:, t] = np.where(done, running, 0.0)
                running[done] = 0.0
            traj["obs"][:, T] = obs
            actor.put_many(traj)  # stamped with actor.policy_version; blocks only without credit


try:
    run()
except Closed as exc:  # the learner finished and said so
    print(f"actor exiting: {exc}")
except RLinkError as exc:  # unreachable, refused, or lost for longer than Config.reconnect_timeout
    print(f"actor stopped: {type(exc).__name__}: {exc}")
    sys.exit(1)
