"""A JAX learner with numpy-only actors: PPO on CartPole-v1, the ``rlink demo`` job without torch.

The learner reads trajectories as JAX arrays (``RLinkDataset(format="jax")``), trains with plain
JAX (``jax.grad``, ``jax.jit``, Adam written out), and publishes its params, a nested dict as flax
keeps them, after every update. Each actor process steps a Gymnasium vector env with a numpy MLP
and reads the params back as numpy (``get_remote_model(format="numpy")``): actors never import
torch or JAX.

    pip install -e ".[jax,demo]"
    python examples/jax_learner.py                 # to the demo's target: mean return 475 over 100 episodes
    python examples/jax_learner.py --quick         # target 150, 60 s at most (the CI test)
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import time
from typing import Any

import numpy as np

HIDDEN = 64
OBS, ACTIONS = 4, 2  # CartPole-v1
TOKEN = "jax-example-token-not-a-secret-0123456789"


# --- the policy, in numpy (actors) ------------------------------------------------------------
def mlp(layers: dict[str, Any], x: Any, xp: Any) -> Any:
    """tanh MLP: the same code runs with numpy (actors) and jax.numpy (learner) as ``xp``."""
    h = xp.tanh(x @ layers["w1"] + layers["b1"])
    h = xp.tanh(h @ layers["w2"] + layers["b2"])
    return h @ layers["w3"] + layers["b3"]


def init_params(seed: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)

    def layers(out: int, scale: float) -> dict[str, np.ndarray]:
        def w(i: int, o: int, s: float) -> np.ndarray:
            q, _ = np.linalg.qr(rng.standard_normal((max(i, o), max(i, o))))  # orthogonal, as the demo
            return (q[:i, :o] * s).astype(np.float32)

        return {"w1": w(OBS, HIDDEN, np.sqrt(2)), "b1": np.zeros(HIDDEN, np.float32),
                "w2": w(HIDDEN, HIDDEN, np.sqrt(2)), "b2": np.zeros(HIDDEN, np.float32),
                "w3": w(HIDDEN, out, scale), "b3": np.zeros(out, np.float32)}  # fmt: skip

    return {"pi": layers(ACTIONS, 0.01), "v": layers(1, 1.0)}


def run_actor(address: str, n_envs: int, unroll: int, seed: int, stop: Any) -> None:
    import gymnasium as gym

    from rlink_ucx import Actor

    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(n_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)  # fmt: skip
    rng = np.random.default_rng(seed)
    obs, _ = envs.reset(seed=seed)
    buf = {"obs": np.zeros((n_envs, unroll + 1, OBS), np.float32), "action": np.zeros((n_envs, unroll), np.int64),
           "logp": np.zeros((n_envs, unroll), np.float32), "reward": np.zeros((n_envs, unroll), np.float32),
           "done": np.zeros((n_envs, unroll), bool), "ep_return": np.zeros((n_envs, unroll), np.float32)}  # fmt: skip
    ep_return = np.zeros(n_envs)
    with Actor(address, token=TOKEN, transport="tcp") as actor:
        params, _ = actor.get_remote_model(timeout=120, format="numpy")
        while not stop.is_set():
            params, _ = actor.get_remote_model(latest=False, format="numpy")  # the newest here: no wait
            for t in range(unroll):
                buf["obs"][:, t] = obs
                logits = mlp(params["pi"], obs.astype(np.float32), np)
                logp_all = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
                action = (rng.random((n_envs, 1)) > np.exp(logp_all).cumsum(1)).sum(1).clip(0, ACTIONS - 1)
                obs, reward, terminated, truncated, _ = envs.step(action)
                done = terminated | truncated
                ep_return += reward
                buf["action"][:, t], buf["logp"][:, t] = action, logp_all[np.arange(n_envs), action]
                buf["reward"][:, t], buf["done"][:, t] = reward, done
                buf["ep_return"][:, t] = np.where(done, ep_return, 0.0)
                ep_return[done] = 0.0
            buf["obs"][:, unroll] = obs
            actor.put_many(buf)
        actor.flush(30)


# --- the learner, in JAX ----------------------------------------------------------------------
def make_update(lr: float, epochs: int = 4, minibatches: int = 4) -> Any:
    import jax
    import jax.numpy as jnp

    gamma, lam, clip, vcoef, ecoef, max_norm = 0.99, 0.95, 0.2, 0.5, 0.01, 0.5

    def loss(params: Any, obs: Any, action: Any, old_logp: Any, adv: Any, ret: Any) -> Any:
        logits = mlp(params["pi"], obs, jnp)
        logp_all = jax.nn.log_softmax(logits)
        logp = jnp.take_along_axis(logp_all, action[:, None], 1)[:, 0]
        ratio = jnp.exp(logp - old_logp)
        a = (adv - adv.mean()) / (adv.std() + 1e-8)
        pg = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip, 1 + clip) * a).mean()
        v = mlp(params["v"], obs, jnp)[:, 0]
        entropy = -(jnp.exp(logp_all) * logp_all).sum(1).mean()
        return pg + vcoef * ((ret - v) ** 2).mean() - ecoef * entropy

    def adam(params: Any, grads: Any, state: Any, lr_now: Any) -> tuple[Any, Any]:
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree_util.tree_leaves(grads)))
        grads = jax.tree_util.tree_map(lambda g: g * jnp.minimum(1.0, max_norm / (norm + 1e-6)), grads)
        m, v, t = state
        t = t + 1
        m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
        v = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)
        step = lambda p, m, v: p - lr_now * (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-5)
        return jax.tree_util.tree_map(step, params, m, v), (m, v, t)

    @jax.jit
    def advantages(params: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
        """GAE(lambda) over each trajectory ``[B, T]`` (obs has T + 1 steps: the last bootstraps)."""
        obs, reward, live = batch["obs"], batch["reward"], 1.0 - batch["done"].astype(jnp.float32)
        values = mlp(params["v"], obs, jnp)[..., 0]  # [B, T + 1]

        def gae(last: Any, t: Any) -> tuple[Any, Any]:
            delta = reward[:, t] + gamma * values[:, t + 1] * live[:, t] - values[:, t]
            last = delta + gamma * lam * live[:, t] * last
            return last, last

        _, adv = jax.lax.scan(gae, jnp.zeros(reward.shape[0]), jnp.arange(reward.shape[1])[::-1])
        adv = adv[::-1].T  # [B, T]
        return adv, adv + values[:, :-1]

    @jax.jit
    def step(params: Any, state: Any, minibatch: tuple[Any, ...], lr_now: Any) -> tuple[Any, Any]:
        return adam(params, jax.grad(loss)(params, *minibatch), state, lr_now)

    def update(params: Any, state: Any, batch: dict[str, Any], rng: np.random.Generator, lr_now: float) -> Any:
        adv, ret = advantages(params, batch)
        n = adv.size
        flat = (batch["obs"][:, :-1].reshape(n, -1), batch["action"].reshape(n), batch["logp"].reshape(n),
                adv.reshape(n), ret.reshape(n))  # fmt: skip
        size = n // minibatches
        for _ in range(epochs):
            order = rng.permutation(n)
            for start in range(0, n - size + 1, size):
                idx = jnp.asarray(order[start : start + size])
                params, state = step(params, state, tuple(x[idx] for x in flat), lr_now)
        return params, state

    return update


def train(*, actors: int = 2, envs_per_actor: int = 4, unroll: int = 32, batch: int = 16, target: float = 475.0,
          max_seconds: float = 600.0, seed: int = 1, lr: float = 1e-3, log: bool = True) -> dict[str, Any]:  # fmt: skip
    import jax
    import jax.numpy as jnp

    from rlink_ucx import Config, Learner, RLinkDataset
    from rlink_ucx import TimeoutError as RLinkTimeout

    step_bytes = 4 * ((unroll + 1) * OBS + 4 * unroll) + 8 * unroll  # obs, logp, reward, ep_return, done; action
    config = Config(frame_bytes=envs_per_actor * step_bytes, buffer_bytes=3 * batch * step_bytes,
                    actor_window_bytes=2 * envs_per_actor * step_bytes)  # small buffers: a low policy lag, as the demo
    params = jax.tree_util.tree_map(jnp.asarray, init_params(seed))
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    state = (zeros, zeros, jnp.zeros((), jnp.int32))
    update = make_update(lr)
    rng = np.random.default_rng(seed)
    returns: collections.deque[float] = collections.deque(maxlen=100)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    with Learner("127.0.0.1:0", token=TOKEN, transport="tcp", config=config) as learner:
        dataset = RLinkDataset(learner, batch_size=batch, format="jax")
        learner.publish(params)  # a nested dict of JAX arrays
        procs = [ctx.Process(target=run_actor, args=(learner.address, envs_per_actor, unroll, seed + 1000 * (i + 1),
                                                     stop)) for i in range(actors)]  # fmt: skip
        for p in procs:
            p.start()
        started = time.monotonic()
        updates, mean, solved = 0, 0.0, False
        try:
            while time.monotonic() - started < max_seconds:
                try:
                    b = dataset.fetch(timeout=5)
                except RLinkTimeout:
                    continue
                finished = np.asarray(b["ep_return"])[np.asarray(b["done"])]
                returns.extend(finished.tolist())
                fraction = max(0.05, 1.0 - (time.monotonic() - started) / max_seconds)
                params, state = update(params, state, dict(b), rng, lr * fraction)
                learner.publish(params)
                updates += 1
                mean = float(np.mean(returns)) if returns else 0.0
                if log and updates % 20 == 0:
                    print(f"update {updates}: mean return {mean:.1f} over {len(returns)} episodes, "
                          f"version {learner.version}, {time.monotonic() - started:.0f} s", flush=True)  # fmt: skip
                if len(returns) == returns.maxlen and mean >= target:
                    solved = True
                    break
            stats = learner.stats()
            seconds = round(time.monotonic() - started, 1)
        finally:
            stop.set()
            deadline = time.monotonic() + 60
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                try:  # keep taking steps: an actor blocked for credit sees the stop flag
                    dataset.fetch(timeout=0.2)
                except RLinkTimeout:
                    pass
            for p in procs:
                p.join(5)
                if p.exitcode is None:
                    p.kill()
            dataset.close()
    return {"solved": solved, "mean_return": mean, "updates": updates, "version": learner.version,
            "seconds": seconds, "trajectories": stats["total"]["steps"],
            "actor_exit_codes": [p.exitcode for p in procs]}  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--target-return", type=float, default=475.0)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="target 150, 60 s at most (the CI test)")
    args = parser.parse_args()
    if args.quick:
        args.target_return, args.max_seconds = min(args.target_return, 150.0), min(args.max_seconds, 60.0)
    result = train(actors=args.actors, target=args.target_return, max_seconds=args.max_seconds, seed=args.seed)
    print(result)
    raise SystemExit(0 if result["solved"] else 2)
