"""On-policy PPO learner: one rollout from each actor per update, every update on the policy that
collected it (docs/on-policy.md walks through it).

    python examples/ppo_onpolicy_learner.py --address 127.0.0.1:8443   # then start the actors:
    python examples/ppo_onpolicy_actor.py --address 127.0.0.1:8443      # one env each, as many as you like

Each update: fetch exactly one rollout (the oldest pending) from each connected actor, in
[T, B] layout, compute GAE with each rollout's bootstrap observation, run PPO's clipped update,
publish the new version. Actors wait for that version before their next rollout.
"""

import argparse
import collections
import time

import numpy as np
import torch

from rlink_ucx import Learner, RLinkDataset, read_token_file
from rlink_ucx.demo.policy import ActorCritic

parser = argparse.ArgumentParser()
parser.add_argument("--address", default="127.0.0.1:8443")
parser.add_argument("--token-file", default=None, help="file holding the shared secret (or set RLINK_TOKEN_FILE)")
parser.add_argument("--updates", type=int, default=500, help="stop after this many updates")
parser.add_argument("--target-return", type=float, default=195.0, help="stop once the last --window episodes average this")
parser.add_argument("--window", type=int, default=50, help="episodes the mean return is taken over")
parser.add_argument("--min-actors", type=int, default=1, help="fewest rollouts an update takes")
parser.add_argument("--straggler-timeout", type=float, default=60.0, help="seconds an update waits for a slow actor")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
GAMMA, LAM, CLIP, EPOCHS, MINIBATCHES, VF_COEF, ENT_COEF, MAX_GRAD_NORM = 0.99, 0.95, 0.2, 4, 4, 0.5, 0.01, 0.5

torch.manual_seed(args.seed)
torch.set_num_threads(1)
model = ActorCritic(4, ("discrete", 2))  # CartPole: obs float32[4], 2 actions
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)


def gae(values: torch.Tensor, reward: torch.Tensor, done: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, time-major: ``values`` [T + 1, B] (the last row is the value of
    each rollout's bootstrap observation), ``reward`` and ``done`` [T, B]."""
    advantages = torch.zeros_like(reward)
    last = torch.zeros_like(reward[0])
    for t in reversed(range(reward.shape[0])):
        live = 1.0 - done[t]
        delta = reward[t] + GAMMA * values[t + 1] * live - values[t]
        last = delta + GAMMA * LAM * live * last
        advantages[t] = last
    return advantages, advantages + values[:-1]


def ppo_update(batch) -> float:
    """PPO's clipped update on one batch of rollouts; returns the fraction of clipped ratios."""
    obs, done = batch["obs"], batch["done"].float()  # obs [T + 1, B, 4]; the rest [T, B]
    with torch.no_grad():
        advantages, returns = gae(model.value(obs), batch["reward"], done)
    n = advantages.numel()
    flat_obs, action = obs[:-1].reshape(n, 4), batch["action"].reshape(n)
    old_logp, advantages, returns = batch["logp"].reshape(n), advantages.reshape(n), returns.reshape(n)
    size = max(1, n // MINIBATCHES)
    clipped = 0.0
    for _ in range(EPOCHS):
        for idx in torch.randperm(n).split(size):
            dist = model.dist(flat_obs[idx])
            ratio = (dist.log_prob(action[idx]) - old_logp[idx]).exp()
            adv = (advantages[idx] - advantages[idx].mean()) / (advantages[idx].std() + 1e-8)
            policy_loss = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
            value_loss = (model.value(flat_obs[idx]) - returns[idx]).pow(2).mean()
            loss = policy_loss + VF_COEF * value_loss - ENT_COEF * dist.entropy().mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            clipped = ((ratio.detach() - 1).abs() > CLIP).float().mean().item()
    return clipped


token = read_token_file(args.token_file) if args.token_file else None  # never on argv: `ps` shows it
with Learner(args.address, token=token) as learner:
    learner.publish(model)  # version 1: actors wait for it before their first rollout
    print(f"learner on {learner.address}; start actors with: "
          f"python examples/ppo_onpolicy_actor.py --address {learner.address}", flush=True)
    # One rollout per actor per update, as [T, B]; max_staleness=0 drops (and counts) a rollout
    # of an older version (an actor that joined late) instead of training on it.
    dataset = RLinkDataset(learner, batch_size=8, time_major=True, max_staleness=0)
    returns: collections.deque[float] = collections.deque(maxlen=args.window)
    env_steps, started = 0, time.monotonic()
    for update in range(1, args.updates + 1):
        batch = dataset.fetch(timeout=args.straggler_timeout, one_per_actor=True, min_actors=args.min_actors)
        assert (batch.version == learner.version).all()  # on-policy: collected with the version we hold
        returns.extend(batch["ep_return"][batch["done"]].tolist())
        env_steps += batch["reward"].numel()
        clipped = ppo_update(batch)
        learner.publish(model)  # returns at once; each actor waits for it (newer_than)
        mean = float(np.mean(returns)) if returns else 0.0
        print(f"update {update}: version {int(batch.version[0])} from actors {batch.actor_id.tolist()}, "
              f"{env_steps} env steps, mean return {mean:.1f}, clipped {clipped:.2f}, "
              f"{time.monotonic() - started:.0f}s", flush=True)
        if len(returns) == returns.maxlen and mean >= args.target_return:
            print(f"solved: mean return {mean:.1f} over the last {len(returns)} episodes after {env_steps} env steps",
                  flush=True)
            break
print("learner done", flush=True)
