"""Prefill / update attention: the explicit einsum path against jax.nn.dot_product_attention (XLA).

    PYTHONPATH=. python benchmarks/attention.py     # CPU seconds and wall seconds per call, 15 calls

The einsum path is written out here as it was before the model switched to dot_product_attention.
"""
import time, jax, jax.numpy as jnp


def einsum_attention(q_bthe, k_bske, v_bske, mask_bts):
    b, t, h, e = q_bthe.shape
    kv = k_bske.shape[2]
    q = q_bthe.reshape(b, t, kv, h // kv, e)
    scores = jnp.einsum("btkge,bske->bkgts", q, k_bske, preferred_element_type=jnp.float32)
    scores = jnp.where(mask_bts[:, None, None], scores * (e ** -0.5), -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bske.dtype)
    return jnp.einsum("bkgts,bske->btkge", probs, v_bske).reshape(b, t, h, e)


b, t, n, k, e = 8, 256, 16, 8, 128
ks = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(ks[0], (b, t, n, e)); kk = jax.random.normal(ks[1], (b, t, k, e)); v = jax.random.normal(ks[2], (b, t, k, e))
pos = jnp.arange(t); mask = jnp.broadcast_to(pos[None, :] <= pos[:, None], (b, t, t))
einsum = lambda q, kk, v: einsum_attention(q, kk, v, mask)
dpa = lambda q, kk, v: jax.nn.dot_product_attention(q, kk, v, mask=mask[:, None], implementation="xla")
for name, f in (("einsum", einsum), ("dot_product_attention", dpa)):
    fwd = jax.jit(f); g = jax.jit(jax.grad(lambda q, kk, v: f(q, kk, v).sum(), argnums=(0, 1, 2)))
    jax.block_until_ready(fwd(q, kk, v)); jax.block_until_ready(g(q, kk, v))
    for label, fn in (("fwd", fwd), ("fwd+bwd", g)):
        c = time.process_time(); w = time.perf_counter()
        for _ in range(15): jax.block_until_ready(fn(q, kk, v))
        print(name, label, "cpu s/call %.3f wall %.3f" % ((time.process_time() - c) / 15, (time.perf_counter() - w) / 15))
print("max diff", float(jnp.abs(einsum(q, kk, v) - dpa(q, kk, v)).max()))
