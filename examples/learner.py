"""Learner: trains PPO on trajectories streamed by actor.py processes, publishes the policy.

    python examples/learner.py --address 127.0.0.1:8443   # then start actors (same user: no token to type)
    rlink token --file ~/.rlink-token                      # across hosts: copy the file to each host
    python examples/learner.py --address 0.0.0.0:8443 --token-file ~/.rlink-token
"""

import argparse
import collections
import socket
import time

print("learner starting (loading torch and the policy)", flush=True)  # torch takes seconds to import

import numpy as np

from rlink_ucx import Config, Learner, RLinkDataset, TimeoutError, read_token_file
from rlink_ucx.demo.policy import ActorCritic
from rlink_ucx.demo.ppo import PPO, PPOConfig

parser = argparse.ArgumentParser()
parser.add_argument("--address", default="127.0.0.1:8443")
parser.add_argument("--token-file", default=None, help="file holding the shared secret, mode 0600 (or set RLINK_TOKEN_FILE)")
parser.add_argument("--device", default="cpu")
parser.add_argument("--batch", type=int, default=16, help="trajectories per update")
parser.add_argument("--target-return", type=float, default=475.0)
args = parser.parse_args()

# CartPole: obs float32[4], 2 actions. Small buffers keep the actors' policy lag low.
model = ActorCritic(4, ("discrete", 2)).to(args.device)
ppo = PPO(model, PPOConfig())
config = Config(buffer_bytes=64 << 10, actor_window_bytes=16 << 10, frame_bytes=8 << 10)
token = read_token_file(args.token_file) if args.token_file else None  # never on argv: `ps` shows it
with Learner(args.address, token=token, config=config) as learner:
    learner.publish(model)  # version 1: actors wait for it before they start
    host = learner.address.rsplit(":", 1)[0]
    if host in ("0.0.0.0", "[::]"):  # listening on every interface: other hosts use this host's name
        host = socket.gethostname()
    token_flag = f" --token-file {args.token_file}" if args.token_file else ""
    print(f"learner on {learner.address}; start actors with: "
          f"python examples/actor.py --address {host}:{learner.port}{token_flag}")
    dataset = RLinkDataset(learner, batch_size=args.batch, device=args.device)
    returns = collections.deque(maxlen=100)
    update, last_line = 0, time.monotonic()
    while True:
        try:  # wait at most until the next progress line is due (one every 10 s, batches or not)
            batch = dataset.fetch(timeout=max(0.1, last_line + 10 - time.monotonic()))
        except TimeoutError:
            batch = None
        if batch is not None:  # already on args.device
            returns.extend(batch["ep_return"][batch["done"]].tolist())
            ppo.update(batch)  # PPO's clipped ratio corrects for batch.staleness (policy lag)
            learner.publish(model)  # returns at once; actors receive it in the background
            update += 1
        if time.monotonic() - last_line >= 10:
            last_line = time.monotonic()
            s = learner.stats()
            print(f"update {update}: {s['total']['steps'] * 32:,} env steps, mean return "
                  f"{np.mean(returns) if returns else 0:.1f}, lag {s['staleness']['mean']:.2f}, "
                  f"{s['connected_actors']} actors", flush=True)
        if len(returns) == 100 and np.mean(returns) >= args.target_return:
            print(f"solved: mean return {np.mean(returns):.1f} over the last 100 episodes")
            break
