"""`U.parameter_specs`: the u-muP type of each parameter, read from the program (plain JAX,
Flax linen, a scanned stack), and used by `U.optim`."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scaled_arithmetics.unit_scaling as U

ParamSpec = U.optim.ParamSpec
VOCAB, SEQ, D, LAYERS = 11, 8, 16, 2


def _init(seed):
    """Parameters from numpy draws (a `jax.random` draw compiles once per shape)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    blocks = [
        {
            "ln": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
            "qkv": normal(D, 3 * D),
            "proj": normal(D, D),
            "fc": {"w": normal(D, 4 * D), "b": jnp.zeros(4 * D)},
            "fc_proj": normal(4 * D, D),
        }
        for _ in range(LAYERS)
    ]
    return {
        "wte": normal(VOCAB, D),
        "wpe": normal(SEQ, D),
        "blocks": blocks,
        "head": normal(D, VOCAB),
        "step": jnp.zeros((), jnp.int32),
        "unused": None,
    }


def _norm(x, p):
    mean = jnp.mean(x, -1, keepdims=True)
    normed = (x - mean) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5)
    return normed * p["scale"][None, :] + p["bias"][None, :]


def _block(x, p):
    q, k, v = jnp.split(_norm(x, p["ln"]) @ p["qkv"], 3, axis=-1)
    weights = jax.nn.softmax(q @ k.T / math.sqrt(D), axis=-1)
    x = x + (weights @ v) @ p["proj"]
    return x + jax.nn.gelu(_norm(x, p["ln"]) @ p["fc"]["w"] + p["fc"]["b"][None, :]) @ p["fc_proj"]


def _loss(params, tokens):
    x = params["wte"][tokens] + params["wpe"]
    for p in params["blocks"]:
        x = _block(x, p)
    logits = x @ params["head"]
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(SEQ), tokens])


TOKENS = jnp.arange(SEQ, dtype=jnp.int32) % VOCAB


def _flat(specs):
    leaves = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda s: isinstance(s, ParamSpec) or s is None
    )[0]
    return {jax.tree_util.keystr(path): spec for path, spec in leaves}


def test_a_transformer_s_parameters_get_their_kind_fan_in_and_depth():
    params = _init(0)
    specs = _flat(U.parameter_specs(_loss, params, TOKENS))
    block = "['blocks'][1]"
    assert specs["['wte']"] == ParamSpec("embedding", D)
    assert specs["['wpe']"] == ParamSpec("embedding", D)  # an added position table
    assert specs["['head']"] == ParamSpec("output", D)
    assert specs[f"{block}['qkv']"] == ParamSpec("weight", D, depth=LAYERS)
    assert specs[f"{block}['fc_proj']"] == ParamSpec("weight", 4 * D, depth=LAYERS)
    assert specs[f"{block}['fc']['b']"] == ParamSpec("bias", depth=LAYERS)
    assert specs[f"{block}['ln']['scale']"] == ParamSpec("norm", depth=LAYERS)
    assert specs[f"{block}['ln']['bias']"] == ParamSpec("bias", depth=LAYERS)
    assert specs["['step']"] is None and specs["['unused']"] is None


def test_readout_none_makes_the_last_matmul_a_weight():
    params = _init(0)
    specs = U.parameter_specs(_loss, params, TOKENS, readout="none")
    assert specs["head"] == ParamSpec("weight", D)
    with pytest.raises(ValueError, match="readout must be 'last' or 'none'"):
        U.parameter_specs(_loss, params, TOKENS, readout="first")


def test_a_scanned_stack_and_a_jitted_block_are_read_through():
    params = _init(0)
    stacked = dict(
        params, blocks=jax.tree_util.tree_map(lambda *a: jnp.stack(a), *params["blocks"])
    )

    def scanned(p, tokens):
        x = p["wte"][tokens] + p["wpe"]
        x, _ = jax.lax.scan(lambda h, b: (jax.jit(_block)(h, b), None), x, p["blocks"])
        return jnp.mean(x @ p["head"])

    specs = U.parameter_specs(scanned, stacked, TOKENS)
    assert specs["blocks"]["fc"]["w"].kind == "weight"
    assert specs["blocks"]["fc"]["w"].fan_in == D
    # The scan runs its body once per layer: the depth is the unrolled model's.
    assert len(params["blocks"]) > 1
    assert specs["blocks"]["fc"]["w"].depth == len(params["blocks"])
    assert specs["blocks"]["ln"]["scale"].kind == "norm"
    assert specs["head"].kind == "output"


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D)(ids)
        x = nn.LayerNorm()(x)
        x = nn.gelu(nn.Dense(4 * D)(x))
        return nn.Dense(VOCAB)(x)


def test_flax_linen_modules():
    model = _Mlp()
    # The variables' tree, its arrays zeros: the specs are read from the program, not the
    # values (running the init compiles each of its operations).
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(1), TOKENS)
    variables = jax.tree.map(lambda s: jnp.asarray(np.zeros(s.shape, s.dtype)), shapes)
    specs = U.parameter_specs(model.apply, variables, TOKENS)["params"]
    assert specs["Embed_0"]["embedding"] == ParamSpec("embedding", D)
    assert specs["LayerNorm_0"]["scale"] == ParamSpec("norm")
    assert specs["LayerNorm_0"]["bias"] == ParamSpec("bias")
    assert specs["Dense_0"]["kernel"] == ParamSpec("weight", D)
    assert specs["Dense_0"]["bias"] == ParamSpec("bias")
    assert specs["Dense_1"]["kernel"] == ParamSpec("output", 4 * D)


@pytest.mark.slow
def test_specs_drive_u_optim_adam_through_a_unit_scaled_training_step():
    params = U.unit_init(_init(0))
    params.pop("step"), params.pop("unused")
    specs = U.parameter_specs(_loss, params, TOKENS)
    opt = U.optim.adam(0.1, specs)
    loss = U.unit_scale(_loss, readout="umup")

    @jax.jit
    def step(p, state):
        grads = jax.grad(loss)(p, TOKENS)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), updates, state

    state = opt.init(params)
    new, updates, state = step(params, state)
    # The first Adam step is lr * sign(g) * multiplier: the multiplier of each kind shows.
    first = {
        "head": 1.0,
        "wte": D**-0.5,
        "blocks": {"qkv": D**-0.5 * LAYERS**-0.5, "fc_proj": (4 * D) ** -0.5 * LAYERS**-0.5},
    }
    np.testing.assert_allclose(np.abs(updates["head"]).max(), 0.1 * first["head"], rtol=1e-3)
    np.testing.assert_allclose(np.abs(updates["wte"]).max(), 0.1 * first["wte"], rtol=1e-3)
    for name, scale in first["blocks"].items():
        np.testing.assert_allclose(np.abs(updates["blocks"][0][name]).max(), 0.1 * scale, rtol=1e-3)
    jitted = jax.jit(loss)  # one compile (eager, one per operation)
    before, after = jitted(params, TOKENS), jitted(new, TOKENS)
    assert float(after) < float(before)
