"""A character-level GPT in plain JAX, in the style of nanoGPT.

Pre-norm blocks (layer norm, causal multi-head attention, GELU MLP), learned
position embeddings, token embedding tied with the output projection. Parameters
are a dict pytree, so they convert to ScaledArrays with `jsa.as_scaled_array`
and run under `jsa.autoscale` unchanged.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> config = GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=32)
    >>> params = init_params(jax.random.PRNGKey(0), config)
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> logits = forward(params, tokens, config)
    >>> logits.shape
    (2, 16, 65)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model: vocabulary, context length, depth, heads and width."""

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    layer_norm_eps: float = 1e-5
    # Each block under `jax.checkpoint`: its activations recomputed in the backward pass
    # instead of stored (how models too large for their accelerator's memory train).
    remat: bool = False


def init_params(key: jax.Array, config: GPTConfig) -> Params:
    """float32 parameters, initialised as nanoGPT does (normal(0.02), scaled projections)."""
    d = config.n_embd
    keys = iter(jax.random.split(key, 2 + 4 * config.n_layer))
    std = 0.02
    proj_std = std / math.sqrt(2 * config.n_layer)

    def normal(shape: tuple[int, ...], scale: float) -> jax.Array:
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    def layer_norm() -> Params:
        return {"gamma": jnp.ones((d,), jnp.float32), "beta": jnp.zeros((d,), jnp.float32)}

    blocks = []
    for _ in range(config.n_layer):
        blocks.append(
            {
                "ln1": layer_norm(),
                "qkv": normal((d, 3 * d), std),
                "qkv_b": jnp.zeros((3 * d,), jnp.float32),
                "proj": normal((d, d), proj_std),
                "proj_b": jnp.zeros((d,), jnp.float32),
                "ln2": layer_norm(),
                "fc": normal((d, 4 * d), std),
                "fc_b": jnp.zeros((4 * d,), jnp.float32),
                "fc_proj": normal((4 * d, d), proj_std),
                "fc_proj_b": jnp.zeros((d,), jnp.float32),
            }
        )
    return {
        "wte": normal((config.vocab_size, d), std),
        "wpe": normal((config.block_size, d), std),
        "blocks": blocks,
        "lnf": layer_norm(),
    }


def layer_norm(x: jax.Array, p: Params, eps: float) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["gamma"] + p["beta"]


def attention(x: jax.Array, p: Params, n_head: int) -> jax.Array:
    batch, seq, d = x.shape
    head = d // n_head
    qkv = x @ p["qkv"] + p["qkv_b"]
    q, k, v = jnp.split(qkv, 3, axis=-1)

    def heads(t: jax.Array) -> jax.Array:
        return t.reshape(batch, seq, n_head, head).transpose(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(head))
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d)
    return out @ p["proj"] + p["proj_b"]


def mlp(x: jax.Array, p: Params) -> jax.Array:
    hidden = jax.nn.gelu(x @ p["fc"] + p["fc_b"])
    return hidden @ p["fc_proj"] + p["fc_proj_b"]


def block(x: jax.Array, p: Params, config: GPTConfig) -> jax.Array:
    x = x + attention(layer_norm(x, p["ln1"], config.layer_norm_eps), p, config.n_head)
    return x + mlp(layer_norm(x, p["ln2"], config.layer_norm_eps), p)


def stack_blocks(params: Params) -> Params:
    """The same parameters with the blocks stacked along a leading layer axis: `forward`
    then runs the blocks as a `lax.scan` (one block's program, whatever the depth)."""
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *params["blocks"])
    return dict(params, blocks=stacked)


def forward(params: Params, tokens: jax.Array, config: GPTConfig) -> jax.Array:
    """Logits of shape (batch, seq, vocab) for int32 tokens of shape (batch, seq).

    `params["blocks"]` is a list of blocks, or one stacked block (`stack_blocks`) scanned over.
    """
    seq = tokens.shape[1]
    x = params["wte"][tokens] + params["wpe"][:seq]
    run = jax.checkpoint(block, static_argnums=2) if config.remat else block
    if isinstance(params["blocks"], dict):
        x, _ = jax.lax.scan(lambda h, p: (run(h, p, config), None), x, params["blocks"])
    else:
        for p in params["blocks"]:
            x = run(x, p, config)
    x = layer_norm(x, params["lnf"], config.layer_norm_eps)
    return x @ params["wte"].T


def loss_fn(params: Params, tokens: jax.Array, targets: jax.Array, config: GPTConfig) -> jax.Array:
    """Mean cross-entropy of next-token prediction."""
    logits = forward(params, tokens, config)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)
