"""A model zoo: small transformers written as users of Flax linen, Flax NNX and Equinox write
them, with their data and their training steps in each framework's idiom.

- Flax linen: a decoder-only language model (GPT-2-like: token and learned position
  embeddings, pre-LayerNorm blocks of causal `nn.MultiHeadDotProductAttention` and a gelu
  MLP, a final LayerNorm and a head tied to the embedding), trained with
  `flax.training.train_state.TrainState` and `state.apply_gradients`.
- Flax NNX: a Llama/Gemma-like language model (grouped-query attention with fewer key/value
  heads than query heads, rotary position embeddings, RMSNorm, a SwiGLU MLP, a tied
  `nnx.Embed` head), trained with the functional NNX API: `nnx.split(model, nnx.Param, ...)`
  outside the step, `nnx.merge` inside, `jax.value_and_grad` over the parameter `State` and a
  plain optax update with `optax.apply_updates`.
- Equinox: a BERT-like encoder classifier (token and position `eqx.nn.Embedding`s,
  post-LayerNorm blocks of `eqx.nn.MultiheadAttention` with a padding mask, dropout active
  in training, a tanh pooler on the first token and a linear classifier), trained with the
  step of the Equinox docs: `eqx.filter_value_and_grad`, `tx.update` on
  `eqx.filter(model, eqx.is_inexact_array)` and `eqx.apply_updates`.

Each `*_case(dtype, optimizer)` returns a :class:`Case`: the training state, a batch and the
jitted step. With `dtype` set (float16, bfloat16) the parameters are converted with
`jsa.as_scaled_array(..., dtype=dtype)` and the step is the same function under
`jsa.autoscale` (`jax.jit(jsa.autoscale(step))`, `eqx.filter_jit(jsa.autoscale(step))`);
with `reference=True` it is the plain float32 step from the values those scaled parameters
represent, so that the two runs start from the same numbers. `optimizer` is a factory of
the optax transformation (default `optax.adam(1e-3)`; for Equinox the docs' clip-and-Adam
chain): `jsa.optax.scale_optimizer(...)` for float16 data, plain optax for bfloat16. The
optimizer's state is `tx.init(params)` as users write it (`TrainState.create`,
`tx.init(eqx.filter(model, eqx.is_inexact_array))`), outside the step.

The models keep broadcasting explicit (`jax_numpy_rank_promotion="raise"` in the tests).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import jax_scaled_arithmetics as jsa

OptimizerFactory = Callable[[], optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class ZooConfig:
    vocab_size: int = 64
    seq_len: int = 16
    batch_size: int = 4
    d_model: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2  # NNX model: grouped-query attention
    num_layers: int = 2
    mlp_dim: int = 64
    num_classes: int = 4  # Equinox classifier
    dropout: float = 0.1  # Equinox encoder


CONFIG = ZooConfig()
PAD, CLS = 0, 1  # Equinox encoder's special tokens


def default_optimizer() -> optax.GradientTransformation:
    return optax.adam(1e-3)


# ---------------------------------------------------------------------------------------------
# Data: deterministic synthetic tokens (numpy RNG).


def _progressions(rng: np.random.Generator, cfg: ZooConfig, length: int) -> tuple[Any, Any]:
    """Arithmetic progressions modulo the vocabulary (random start, stride 1..4), with 10% of
    the tokens replaced by random ones; returns the tokens and the strides."""
    start = rng.integers(0, cfg.vocab_size, (cfg.batch_size, 1))
    stride = rng.integers(1, 5, (cfg.batch_size, 1))
    tokens = (start + stride * np.arange(length)) % cfg.vocab_size
    noise = rng.random(tokens.shape) < 0.1
    tokens = np.where(noise, rng.integers(0, cfg.vocab_size, tokens.shape), tokens)
    return tokens, stride[:, 0]


def lm_batch(cfg: ZooConfig = CONFIG, seed: int = 0) -> dict[str, jax.Array]:
    """Next-token prediction: `inputs` and `targets` (the inputs shifted by one), int32."""
    tokens, _ = _progressions(np.random.default_rng(seed), cfg, cfg.seq_len + 1)
    return {
        "inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
        "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
    }


def classification_batch(cfg: ZooConfig = CONFIG, seed: int = 0) -> dict[str, jax.Array]:
    """`[CLS]` + a progression of random length, padded with `PAD`; the label is the
    progression's stride (0..3). `mask` is True on the real tokens."""
    rng = np.random.default_rng(seed)
    tokens, stride = _progressions(rng, cfg, cfg.seq_len)
    tokens = np.clip(tokens, 2, None)  # keep PAD and CLS special
    tokens[:, 0] = CLS
    lengths = rng.integers(cfg.seq_len // 2, cfg.seq_len + 1, cfg.batch_size)
    mask = np.arange(cfg.seq_len)[None, :] < lengths[:, None]
    return {
        "tokens": jnp.asarray(np.where(mask, tokens, PAD), jnp.int32),
        "mask": jnp.asarray(mask),
        "labels": jnp.asarray(stride - 1, jnp.int32),
    }


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ---------------------------------------------------------------------------------------------
# The case: what the tests (and the benchmarks) run.


@dataclasses.dataclass
class Case:
    """A model, a batch and its jitted training step, in one framework's idiom.

    `state` is what the step threads: a linen `TrainState`; NNX `(params, opt_state)`;
    Equinox `(model, opt_state, key)`. `step(state, batch)` returns `(state, loss)`;
    `params(state)` the trainable parameters (the linen params dict, the NNX `State` of
    `nnx.Param`s, the Equinox module) and `key(state)` the dropout key of the next step (None
    without dropout). The parts of the step, for checks: `loss_and_grad(params, batch, key)`,
    the loss and gradients the step computes (jitted like the step), and `update(state,
    grads)`, the optimizer's updates for these gradients, not applied (under `jsa.autoscale`
    for a scaled case, not jitted: op by op, it costs less than compiling it once).
    """

    name: str
    state: Any
    batch: Any
    step: Callable[[Any, Any], tuple[Any, Any]]
    params: Callable[[Any], Any]
    key: Callable[[Any], Any]
    loss_and_grad: Callable[[Any, Any, Any], tuple[Any, Any]]
    update: Callable[[Any, Any], Any]


def _represented(tree: Any, dtype: Any) -> Any:
    """Every floating array as a ScaledArray with `dtype` data, and the float32 values it
    represents (the reference run's starting point)."""
    scaled = jsa.as_scaled_array(tree, dtype=dtype)
    return scaled, jsa.asarray(scaled, jnp.float32)


def _jit(fn: Callable[..., Any], scaled: bool) -> Callable[..., Any]:
    return jax.jit(jsa.autoscale(fn) if scaled else fn)


def _eager(fn: Callable[..., Any], scaled: bool) -> Callable[..., Any]:
    return jsa.autoscale(fn) if scaled else fn


# ---------------------------------------------------------------------------------------------
# Flax linen: a GPT-2-like decoder.


class MlpBlock(nn.Module):
    mlp_dim: int
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.mlp_dim, dtype=self.dtype, param_dtype=self.param_dtype)(x)
        h = nn.gelu(h)
        return nn.Dense(x.shape[-1], dtype=self.dtype, param_dtype=self.param_dtype)(h)


class DecoderBlock(nn.Module):
    num_heads: int
    mlp_dim: int
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask):
        y = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            use_bias=False,
        )(y, mask=mask)
        x = x + y
        y = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype)(x)
        return x + MlpBlock(self.mlp_dim, dtype=self.dtype, param_dtype=self.param_dtype)(y)


class TransformerLM(nn.Module):
    vocab_size: int
    max_len: int
    d_model: int
    num_heads: int
    num_layers: int
    mlp_dim: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(
            self.vocab_size,
            self.d_model,
            embedding_init=nn.initializers.normal(0.02),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        pos_embedding = self.param(
            "pos_embedding",
            nn.initializers.normal(0.02),
            (1, self.max_len, self.d_model),
            self.param_dtype,
        )
        x = embed(tokens) + pos_embedding[:, : tokens.shape[-1]].astype(self.dtype)
        mask = nn.make_causal_mask(tokens)
        for i in range(self.num_layers):
            x = DecoderBlock(
                self.num_heads,
                self.mlp_dim,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name=f"block_{i}",
            )(x, mask)
        x = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="ln_f")(x)
        return embed.attend(x)  # the head tied to the token embedding


def linen_lm(cfg: ZooConfig = CONFIG, dtype: Any = jnp.float32) -> TransformerLM:
    return TransformerLM(
        vocab_size=cfg.vocab_size,
        max_len=cfg.seq_len,
        d_model=cfg.d_model,
        num_heads=cfg.num_heads,
        num_layers=cfg.num_layers,
        mlp_dim=cfg.mlp_dim,
        dtype=dtype,
    )


def linen_lm_init(cfg: ZooConfig = CONFIG, seed: int = 0) -> tuple[TransformerLM, Any]:
    """The float32 model and its variables (`{"params": ...}`)."""
    model = linen_lm(cfg)
    return model, model.init(jax.random.PRNGKey(seed), lm_batch(cfg)["inputs"])


def linen_loss_and_grad(apply_fn: Callable[..., Any], params: Any, batch: Any) -> Any:
    def loss_fn(params):
        logits = apply_fn({"params": params}, batch["inputs"])
        return lm_loss(logits, batch["targets"])

    return jax.value_and_grad(loss_fn)(params)


def linen_train_step(state: train_state.TrainState, batch: Any) -> Any:
    loss, grads = linen_loss_and_grad(state.apply_fn, state.params, batch)
    state = state.apply_gradients(grads=grads)
    return state, loss


def linen_update(state: train_state.TrainState, grads: Any) -> Any:
    updates, _ = state.tx.update(grads, state.opt_state, state.params)
    return updates


def linen_lm_case(
    dtype: Any = None,
    optimizer: OptimizerFactory = default_optimizer,
    *,
    reference: bool = False,
    cfg: ZooConfig = CONFIG,
) -> Case:
    """The linen LM: `dtype` the data dtype of the scaled parameters (and the modules'
    computation `dtype`); `dtype=None`, or `reference=True`, the plain float32 program."""
    _, variables = linen_lm_init(cfg)
    scaled = dtype is not None and not reference
    params = variables["params"]
    if dtype is not None:
        params, values = _represented(params, dtype)
        params = params if scaled else values
    model = linen_lm(cfg, dtype if scaled else jnp.float32)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optimizer())

    def loss_and_grad(params, batch, key=None):
        return linen_loss_and_grad(model.apply, params, batch)

    return Case(
        name="linen",
        state=state,
        batch=lm_batch(cfg),
        step=_jit(linen_train_step, scaled),
        params=lambda state: state.params,
        key=lambda state: None,
        loss_and_grad=_jit(loss_and_grad, scaled),
        update=_eager(linen_update, scaled),
    )


# ---------------------------------------------------------------------------------------------
# Flax NNX: a Llama/Gemma-like decoder.


class RopeTable(nnx.Variable):
    """A precomputed, non-trainable table (the rotary embedding's sines and cosines)."""


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.zeros((dim,)))  # Gemma: the gain is 1 + scale
        self.eps = eps

    def __call__(self, x):
        variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        gain = (1 + self.scale[...]).reshape((1,) * (x.ndim - 1) + (-1,))
        return x * jax.lax.rsqrt(variance + self.eps) * gain


class RotaryEmbedding(nnx.Module):
    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0):
        half = head_dim // 2
        inv_freq = base ** (-np.arange(half, dtype=np.float32) / half)
        angles = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :]
        self.sin = RopeTable(jnp.asarray(np.sin(angles)))
        self.cos = RopeTable(jnp.asarray(np.cos(angles)))

    def __call__(self, x):
        """x: (batch, seq, heads, head_dim); rotated in float32, returned in x's dtype."""
        seq = x.shape[1]
        sin = self.sin[:seq][None, :, None, :]
        cos = self.cos[:seq][None, :, None, :]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.astype(x.dtype)


class GroupedQueryAttention(nnx.Module):
    def __init__(self, d_model, num_heads, num_kv_heads, max_len, *, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_model // num_heads
        linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.q_proj = linear(d_model, num_heads * self.head_dim)
        self.k_proj = linear(d_model, num_kv_heads * self.head_dim)
        self.v_proj = linear(d_model, num_kv_heads * self.head_dim)
        self.o_proj = linear(num_heads * self.head_dim, d_model)
        self.rope = RotaryEmbedding(self.head_dim, max_len)

    def __call__(self, x, mask):
        batch, seq, _ = x.shape
        groups = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).reshape(batch, seq, self.num_kv_heads, groups, self.head_dim)
        k = self.k_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim)
        q = self.rope(q.reshape(batch, seq, self.num_heads, self.head_dim))
        q = q.reshape(batch, seq, self.num_kv_heads, groups, self.head_dim)
        k = self.rope(k)
        logits = jnp.einsum("bskgd,btkd->bkgst", q, k) * self.head_dim**-0.5
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
        out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))


class SwiGLU(nnx.Module):
    def __init__(self, d_model, hidden, *, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.gate_proj = linear(d_model, hidden)
        self.up_proj = linear(d_model, hidden)
        self.down_proj = linear(hidden, d_model)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ZooConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = GroupedQueryAttention(
            cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.seq_len, rngs=rngs
        )
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_dim, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.attn_norm(x), mask)
        return x + self.mlp(self.mlp_norm(x))


class LlamaLM(nnx.Module):
    def __init__(self, cfg: ZooConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model)
        self.d_model = cfg.d_model

    def __call__(self, tokens):
        seq = tokens.shape[-1]
        mask = jnp.tril(jnp.ones((1, 1, 1, seq, seq), bool))  # causal; (b, k, g, s, t)
        x = self.embed(tokens)
        x = x * jnp.sqrt(self.d_model).astype(x.dtype)  # Gemma's embedding normalizer
        for layer in self.layers:
            x = layer(x, mask)
        x = self.final_norm(x)
        return self.embed.attend(x).astype(jnp.float32)  # tied head, float32 logits


def nnx_init(cfg: ZooConfig = CONFIG, seed: int = 0) -> LlamaLM:
    return LlamaLM(cfg, rngs=nnx.Rngs(seed))


def nnx_loss_and_grad(graphdef: Any, rest: Any, params: Any, batch: Any) -> Any:
    def loss_fn(params):
        model = nnx.merge(graphdef, params, rest)
        return lm_loss(model(batch["inputs"]), batch["targets"])

    return jax.value_and_grad(loss_fn)(params)


def make_nnx_train_step(graphdef: Any, rest: Any, tx: optax.GradientTransformation) -> Any:
    def train_step(params, opt_state, batch):
        loss, grads = nnx_loss_and_grad(graphdef, rest, params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return train_step


def nnx_case(
    dtype: Any = None,
    optimizer: OptimizerFactory = default_optimizer,
    *,
    reference: bool = False,
    cfg: ZooConfig = CONFIG,
) -> Case:
    """The NNX LM; `dtype`, `reference` as in :func:`linen_lm_case`. Only the `nnx.Param`s
    are converted; the rotary tables (`rest`) stay float32 arrays."""
    graphdef, params, rest = nnx.split(nnx_init(cfg), nnx.Param, ...)
    scaled = dtype is not None and not reference
    if dtype is not None:
        params, values = _represented(params, dtype)
        params = params if scaled else values
    tx = optimizer()
    train_step = _jit(make_nnx_train_step(graphdef, rest, tx), scaled)

    def loss_and_grad(params, batch, key=None):
        return nnx_loss_and_grad(graphdef, rest, params, batch)

    def step(state, batch):
        params, opt_state, loss = train_step(*state, batch)
        return (params, opt_state), loss

    def update(state, grads):
        params, opt_state = state
        return tx.update(grads, opt_state, params)[0]

    return Case(
        name="nnx",
        state=(params, tx.init(params)),
        batch=lm_batch(cfg),
        step=step,
        params=lambda state: state[0],
        key=lambda state: None,
        loss_and_grad=_jit(loss_and_grad, scaled),
        update=_eager(update, scaled),
    )


# ---------------------------------------------------------------------------------------------
# Equinox: a BERT-like encoder classifier.


class EncoderLayer(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    attention_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear
    mlp_norm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, cfg: ZooConfig, *, key: jax.Array):
        k_attn, k_in, k_out = jax.random.split(key, 3)
        self.attention = eqx.nn.MultiheadAttention(
            cfg.num_heads, cfg.d_model, use_query_bias=True, use_output_bias=True, key=k_attn
        )
        self.attention_norm = eqx.nn.LayerNorm(cfg.d_model)
        self.mlp_in = eqx.nn.Linear(cfg.d_model, cfg.mlp_dim, key=k_in)
        self.mlp_out = eqx.nn.Linear(cfg.mlp_dim, cfg.d_model, key=k_out)
        self.mlp_norm = eqx.nn.LayerNorm(cfg.d_model)
        self.dropout = eqx.nn.Dropout(cfg.dropout)

    def __call__(self, x, mask, *, key):
        """x: (seq, d_model); mask: (seq, seq), True where a query may attend to a key."""
        k_attn, k_mlp = jax.random.split(key)
        attn = self.attention(x, x, x, mask=mask)
        x = jax.vmap(self.attention_norm)(x + self.dropout(attn, key=k_attn))
        h = jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(x)))
        return jax.vmap(self.mlp_norm)(x + self.dropout(h, key=k_mlp))


class BertClassifier(eqx.Module):
    token_embedding: eqx.nn.Embedding
    position_embedding: eqx.nn.Embedding
    embedding_norm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout
    layers: list[EncoderLayer]
    pooler: eqx.nn.Linear
    classifier: eqx.nn.Linear
    activation: Callable[[jax.Array], jax.Array] = eqx.field(static=True)

    def __init__(self, cfg: ZooConfig, *, key: jax.Array):
        keys = jax.random.split(key, cfg.num_layers + 4)
        self.token_embedding = eqx.nn.Embedding(cfg.vocab_size, cfg.d_model, key=keys[0])
        self.position_embedding = eqx.nn.Embedding(cfg.seq_len, cfg.d_model, key=keys[1])
        self.embedding_norm = eqx.nn.LayerNorm(cfg.d_model, eps=1e-12)
        self.dropout = eqx.nn.Dropout(cfg.dropout)
        self.layers = [EncoderLayer(cfg, key=k) for k in keys[4:]]
        self.pooler = eqx.nn.Linear(cfg.d_model, cfg.d_model, key=keys[2])
        self.classifier = eqx.nn.Linear(cfg.d_model, cfg.num_classes, key=keys[3])
        self.activation = jax.nn.tanh

    def __call__(self, tokens, mask, *, key):
        """One example: tokens (seq,) int, mask (seq,) bool; returns (num_classes,) logits."""
        keys = jax.random.split(key, len(self.layers) + 2)
        positions = jnp.arange(tokens.shape[0])
        x = jax.vmap(self.token_embedding)(tokens) + jax.vmap(self.position_embedding)(positions)
        x = self.dropout(jax.vmap(self.embedding_norm)(x), key=keys[0])
        attention_mask = jnp.broadcast_to(mask[None, :], (tokens.shape[0], tokens.shape[0]))
        for layer, layer_key in zip(self.layers, keys[2:]):
            x = layer(x, attention_mask, key=layer_key)
        pooled = self.activation(self.pooler(x[0]))  # the [CLS] token
        return self.classifier(self.dropout(pooled, key=keys[1]))


def equinox_init(cfg: ZooConfig = CONFIG, seed: int = 0) -> BertClassifier:
    return BertClassifier(cfg, key=jax.random.PRNGKey(seed))


def equinox_optimizer(learning_rate: float = 1e-3) -> optax.GradientTransformation:
    """The Equinox docs' optimizer."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate))


def equinox_loss(model: BertClassifier, batch: Any, key: jax.Array) -> jax.Array:
    keys = jax.random.split(key, batch["tokens"].shape[0])
    logits = jax.vmap(lambda t, m, k: model(t, m, key=k))(batch["tokens"], batch["mask"], keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def make_equinox_train_step(tx: optax.GradientTransformation) -> Any:
    """The step of the Equinox docs, not yet jitted."""

    def train_step(model, opt_state, batch, key):
        loss, grads = eqx.filter_value_and_grad(equinox_loss)(model, batch, key)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    return train_step


def equinox_case(
    dtype: Any = None,
    optimizer: OptimizerFactory = equinox_optimizer,
    *,
    reference: bool = False,
    cfg: ZooConfig = CONFIG,
) -> Case:
    """The Equinox encoder; `dtype`, `reference` as in :func:`linen_lm_case`. The step is
    `eqx.filter_jit(jsa.autoscale(train_step))` (scaled) or `eqx.filter_jit(train_step)`;
    each step draws its dropout key from the state's key."""
    model = equinox_init(cfg)
    scaled = dtype is not None and not reference
    if dtype is not None:
        model, values = _represented(model, dtype)
        model = model if scaled else values
    tx = optimizer()

    def filter_jit(fn):
        return eqx.filter_jit(jsa.autoscale(fn) if scaled else fn)

    train_step = filter_jit(make_equinox_train_step(tx))

    def step(state, batch):
        model, opt_state, key = state
        key, step_key = jax.random.split(key)
        model, opt_state, loss = train_step(model, opt_state, batch, step_key)
        return (model, opt_state, key), loss

    def step_key(state):
        return jax.random.split(state[2])[1]

    def loss_and_grad(model, batch, key):
        return eqx.filter_value_and_grad(equinox_loss)(model, batch, key)

    def update(state, grads):
        model, opt_state, _ = state
        return tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))[0]

    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    return Case(
        name="equinox",
        state=(model, opt_state, jax.random.PRNGKey(2)),
        batch=classification_batch(cfg),
        step=step,
        params=lambda state: state[0],
        key=step_key,
        loss_and_grad=filter_jit(loss_and_grad),
        update=_eager(update, scaled),
    )


CASES: dict[str, Callable[..., Case]] = {
    "linen": linen_lm_case,
    "nnx": nnx_case,
    "equinox": equinox_case,
}
