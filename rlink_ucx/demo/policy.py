"""The demo's actor-critic: a small MLP for a discrete or box action space."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn


def space_spec(space: Any) -> tuple[str, int]:
    """``("discrete", n)`` or ``("box", dims)`` for a Gymnasium action space."""
    import gymnasium as gym

    if isinstance(space, gym.spaces.Discrete):
        return "discrete", int(space.n)
    if isinstance(space, gym.spaces.Box) and len(space.shape) == 1:
        return "box", int(space.shape[0])
    raise ValueError(f"the demo policy handles Discrete and 1-d Box action spaces, not {space}")


class ActorCritic(nn.Module):
    def __init__(self, obs_dim: int, action: tuple[str, int], hidden: int = 64):
        super().__init__()
        self.kind, self.n = action

        def mlp(out: int, gain: float) -> nn.Sequential:
            head = nn.Linear(hidden, out)
            layers = [nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), head]
            for layer in layers:
                if isinstance(layer, nn.Linear):
                    nn.init.orthogonal_(layer.weight, np.sqrt(2))
                    nn.init.zeros_(layer.bias)
            nn.init.orthogonal_(head.weight, gain)
            return nn.Sequential(*layers)

        self.pi = mlp(self.n, 0.01)
        self.v = mlp(1, 1.0)
        if self.kind == "box":
            self.log_std = nn.Parameter(torch.zeros(self.n))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy head's output and the value: what a ``DistributedDataParallel`` wrapper
        calls (DDP averages the gradients of what passes through ``forward``)."""
        return self.pi(obs), self.value(obs)

    def dist(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        return self.dist_from(self.pi(obs))

    def dist_from(self, out: torch.Tensor) -> torch.distributions.Distribution:
        """The action distribution for the policy head's output ``out``."""
        if self.kind == "discrete":
            return torch.distributions.Categorical(logits=out)
        return torch.distributions.Independent(torch.distributions.Normal(out, self.log_std.exp().expand_as(out)), 1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = self.v(obs)
        return value.squeeze(-1)

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        d = self.dist(torch.as_tensor(obs, dtype=torch.float32))
        action = d.sample()
        return action.numpy(), d.log_prob(action).numpy().astype(np.float32)
