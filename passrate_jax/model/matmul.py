"""The projection every layer's matmul goes through: activations [..., in] times a weight [in, out].

Its value is ``lax.dot_general`` contracting the last ``n_in`` dims of ``x`` with the first ``n_in`` of
``w``; only the gradient is written out. The weight's gradient contracts the token dims (all of ``x``'s
leading dims), and XLA CPU lays such a dot out by transposing its left operand into a fresh
[features, tokens] copy, written with a stride as long as a row: autodiff puts the output gradient on the
left, so the copy is the wider side, e.g. [1024, tokens] instead of [384, tokens] for the MLP's gate and
up projections, or [vocabulary, tokens] for the LM head. Here the narrower side goes on the left: with
the written-out log-softmax gradient (rl.losses.token_logprobs), benchmarks/update.py's step went from
about 40 s to 19-20 s on this project's shared CPU (docs/performance.md, "Policy update"). On GPU and TPU the transposes
fold into the matmul either way; the product is the same.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def _contract_last(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    dims = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    return jax.lax.dot_general(x, w, (dims, ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def project(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """``x [..., *in] . w [*in, *out] -> [..., *out]`` (``in`` is ``n_in`` dims), e.g. ``project(x_btd,
    w_dhe)`` is ``einsum("btd,dhe->bthe")`` and ``project(x_bthe, w_hed, 2)`` is ``einsum("bthe,hed->btd")``."""
    return _contract_last(x, w, n_in)


def _project_fwd(x, w, n_in):
    return _contract_last(x, w, n_in), (x, w)


def _project_bwd(n_in, res, g):
    x, w = res
    lead = x.ndim - n_in  # token dims, shared by x and g
    n_out = w.ndim - n_in
    dx = jax.lax.dot_general(g, w, ((tuple(range(lead, g.ndim)), tuple(range(n_in, w.ndim))), ((), ())))
    tokens = (tuple(range(lead)),) * 2
    if math.prod(x.shape[lead:]) <= math.prod(g.shape[lead:]):
        dw = jax.lax.dot_general(x, g, (tokens, ((), ())))  # [*in, *out]
    else:
        dw_out_in = jax.lax.dot_general(g, x, (tokens, ((), ())))  # [*out, *in]: only w-sized to transpose
        dw = jnp.transpose(dw_out_in, tuple(range(n_out, w.ndim)) + tuple(range(n_out)))
    return dx.astype(x.dtype), dw.astype(w.dtype)


project.defvjp(_project_fwd, _project_bwd)
