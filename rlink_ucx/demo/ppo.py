"""PPO on trajectories from many actors: the behaviour policy's log-probabilities travel with
every step, so the clipped importance ratio corrects for the policy lag (staleness)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .policy import ActorCritic


@dataclass
class PPOConfig:
    lr: float = 1e-3
    gamma: float = 0.99
    lam: float = 0.95
    clip: float = 0.2
    epochs: int = 4
    minibatches: int = 4
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    max_grad_norm: float = 0.5


class PPO:
    """``net``: what the loss calls, the model itself or a ``DistributedDataParallel`` wrapping it
    (``rlink demo --learners N``), whose backward averages the gradients over the ranks."""

    def __init__(self, model: ActorCritic, config: PPOConfig, net: torch.nn.Module | None = None):
        self.model = model
        self.net = model if net is None else net
        self.config = config
        self.opt = torch.optim.Adam(model.parameters(), lr=config.lr, eps=1e-5)

    def set_lr_fraction(self, fraction: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = self.config.lr * max(fraction, 0.05)

    def advantages(self, obs: torch.Tensor, reward: torch.Tensor, done: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE(lambda) over each trajectory ``[B, T]`` (obs has T + 1 steps: the last bootstraps)."""
        c = self.config
        with torch.no_grad():
            values = self.model.value(obs)
        live = 1.0 - done.float()
        adv = torch.zeros_like(reward)
        last = torch.zeros_like(reward[:, 0])
        for t in reversed(range(reward.shape[1])):
            delta = reward[:, t] + c.gamma * values[:, t + 1] * live[:, t] - values[:, t]
            last = delta + c.gamma * c.lam * live[:, t] * last
            adv[:, t] = last
        return adv, adv + values[:, :-1]

    def update(self, batch: Any) -> dict[str, float]:
        c = self.config
        obs = batch["obs"]
        adv, returns = self.advantages(obs, batch["reward"], batch["done"])
        n = adv.numel()
        flat = {
            "obs": obs[:, :-1].reshape(n, -1),
            "action": batch["action"].reshape(n, *batch["action"].shape[2:]),
            "logp": batch["logp"].reshape(n),
            "adv": adv.reshape(n),
            "ret": returns.reshape(n),
        }
        stats = {"loss": 0.0, "clip_frac": 0.0}
        size = n // c.minibatches
        for _ in range(c.epochs):
            order = torch.randperm(n)
            for start in range(0, n - size + 1, size):
                idx = order[start : start + size]
                out, v = self.net(flat["obs"][idx])
                d = self.model.dist_from(out)
                logp = d.log_prob(flat["action"][idx])
                ratio = (logp - flat["logp"][idx]).exp()
                a = flat["adv"][idx]
                a = (a - a.mean()) / (a.std() + 1e-8)
                pg = -torch.min(ratio * a, ratio.clamp(1 - c.clip, 1 + c.clip) * a).mean()
                loss = pg + c.value_coef * (flat["ret"][idx] - v).pow(2).mean() - c.entropy_coef * d.entropy().mean()
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.max_grad_norm)
                self.opt.step()
                stats["loss"] = loss.item()
                stats["clip_frac"] = ((ratio.detach() - 1).abs() > c.clip).float().mean().item()
        return stats
