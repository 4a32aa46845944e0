"""One demo actor process: steps a vectorized Gymnasium env with the newest policy and streams
fixed-length trajectories (one rlink "step" = one env's unroll) to the learner."""

from __future__ import annotations

from typing import Any

import numpy as np


class StopFlag:
    """Tells actor processes to finish: a byte of shared memory, read and written without a lock.
    (A multiprocessing.Event takes a lock in ``is_set``: an actor SIGKILLed while holding it,
    as ``--kill-one-actor-after`` does, left every other actor and the learner's ``set`` blocked
    for good.) Pass it to ``Process`` at creation."""

    def __init__(self, ctx: Any):
        self._flag = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._flag.value = 1

    def is_set(self) -> bool:
        return bool(self._flag.value)


def make_envs(env_id: str, n_envs: int) -> Any:
    import gymnasium as gym

    return gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(n_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)  # fmt: skip


def run_actor(address: str, token: str | None, transport: str, env_id: str, n_envs: int, unroll: int, seed: int,
              stop: Any, reports: Any) -> None:  # fmt: skip
    import signal

    import torch

    from .. import Actor
    from .policy import ActorCritic, space_spec

    # Ctrl-C reaches the whole process group: the learner process handles it and stops the
    # actors through ``stop``, so they flush and report instead of dying mid-frame.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    envs = make_envs(env_id, n_envs)
    kind, n = space_spec(envs.single_action_space)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    model = ActorCritic(obs_dim, (kind, n))
    obs, _ = envs.reset(seed=seed)
    act_shape = () if kind == "discrete" else (n,)
    buf = {
        "obs": np.zeros((n_envs, unroll + 1, obs_dim), np.float32),
        "action": np.zeros((n_envs, unroll, *act_shape), np.int64 if kind == "discrete" else np.float32),
        "logp": np.zeros((n_envs, unroll), np.float32),
        "reward": np.zeros((n_envs, unroll), np.float32),
        "done": np.zeros((n_envs, unroll), bool),
        "ep_return": np.zeros((n_envs, unroll), np.float32),
    }
    ep_return = np.zeros(n_envs)
    low, high = (envs.single_action_space.low, envs.single_action_space.high) if kind == "box" else (None, None)
    with Actor(address, token=token, transport=transport, subscribe=True) as actor:
        actor.load_remote_model(model, timeout=120)
        while not stop.is_set():
            actor.load_remote_model(model, latest=False)  # the newest version already here: no wait
            for t in range(unroll):
                buf["obs"][:, t] = obs.reshape(n_envs, -1)
                action, logp = model.act(buf["obs"][:, t])
                obs, reward, terminated, truncated, _ = envs.step(action if low is None else np.clip(action, low, high))
                done = terminated | truncated
                ep_return += reward
                buf["action"][:, t], buf["logp"][:, t], buf["reward"][:, t], buf["done"][:, t] = action, logp, reward, done
                buf["ep_return"][:, t] = np.where(done, ep_return, 0.0)
                ep_return[done] = 0.0
            buf["obs"][:, unroll] = obs.reshape(n_envs, -1)
            actor.put_many(buf)
        actor.flush(30)
        s = actor.stats()
        reports.put({"actor_id": actor.actor_id, "transport": actor.transport, "trajectories_acked": s["steps_acked"],
                     "env_steps": s["steps_acked"] * unroll, "bytes_sent": s["bytes_sent"]})  # fmt: skip
    envs.close()
