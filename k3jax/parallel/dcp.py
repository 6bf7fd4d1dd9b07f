"""DCP: decode context parallel -- a request's MLA latent pages split over the ranks, partial attention per
rank, merged by log-sum-exp.

Over a 1-D mesh of n ranks (axis "x"), logical page i of every request lives on rank i % n, at the local
page id `local_tables[r][b, i // n]` of rank r's pool (rank r's pool: pages r*Pl .. (r+1)*Pl of the
global [L_mla, n*Pl, page_size, C+R] array). Everything else -- the batch, the KDA / conv states, all
weights -- is replicated: each rank runs the whole model on the same rows, except that an MLA layer

  1. projects the new tokens (replicated), and rank r writes the latents of the positions whose page it owns;
  2. attends (absorbed form) to its own pages only: per query and head a running max m_r, a softmax
     denominator l_r = sum_s exp(s - m_r) and an unnormalised latent sum o_r = sum_s exp(s - m_r) c_s;
  3. merges over the ranks: M = pmax(m_r), o = psum(e^(m_r - M) o_r) / psum(e^(m_r - M) l_r), which is
     the softmax over all pages (a rank with no visible key contributes e^(-inf) = 0);
  4. applies W_UV, the output gate and o_proj (replicated).

So an MLA layer all-reduces B*T*H*(C + 1) fp32 per rank (o and l) plus the max: bytes that do not grow
with the context, while each rank stores and reads 1/n of it. KV memory per request per rank is 1/n.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax import mla
from k3jax.config import ModelConfig
from k3jax.model import DecodeState, StepMeta, embed, last_token_hidden, lm_head
from k3jax.parallel.common import AXIS, cached_mixer, check_tokens, mesh_size, run_decoder

STATE_SPECS = DecodeState(kda=P(), conv=P(), kv_pages=P(None, AXIS))
_NO_KEY = -1e30  # the running max of a rank with no visible key (finite: e^(m_r - M) must be 0, not NaN)


def shard_state(state: DecodeState, mesh: Mesh) -> DecodeState:
    """Places a state pool on the mesh: KDA / conv replicated, the n*Pl MLA pages split (rank r: r*Pl..)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, STATE_SPECS,
                        is_leaf=lambda x: isinstance(x, P))


def global_page_table(local_tables, pages_per_rank: int):
    """The single-device page table equal to a DCP layout: local_tables [n, B, ceil(max_pages/n)] ->
    [B, n * ceil(max_pages/n)] where logical page i is rank i % n's local page local_tables[i % n, b, i // n]
    at global id (i % n) * pages_per_rank + that local id."""
    n, b, m = local_tables.shape
    offsets = (jnp.arange(n) * pages_per_rank)[:, None, None]
    return jnp.transpose(local_tables + offsets, (1, 2, 0)).reshape(b, m * n)


def _write_own_latents(kv_pages, layer, latent, local_table, context_lens, lengths, ranks):
    """Rank-local write of latent [B, T, C+R] at positions context_lens + t (t < lengths) whose logical
    page is this rank's (page % ranks == rank); the others are dropped."""
    rank = jax.lax.axis_index(AXIS)
    num_pages, page_size = kv_pages.shape[1:3]
    t = latent.shape[1]
    pos = context_lens[:, None] + jnp.arange(t)[None, :]
    logical = pos // page_size
    local = jnp.take_along_axis(local_table, jnp.minimum(logical // ranks, local_table.shape[1] - 1), axis=1)
    keep = (jnp.arange(t)[None, :] < lengths[:, None]) & (logical % ranks == rank)
    local = jnp.where(keep, local, num_pages)  # out of range -> dropped
    return kv_pages.at[layer, local, pos % page_size].set(latent.astype(kv_pages.dtype), mode="drop")


def partial_attention(q_latent, q_pe, pages, local_table, query_positions, ranks, *, kv_lora_rank, scale):
    """This rank's share of absorbed MLA: q_latent [B, T, H, C], q_pe [B, T, H, R], pages [Pl, page, C+R],
    local_table [B, Ml] -> (m [B, T, H], l [B, T, H], o [B, T, H, C]) over its own visible keys."""
    rank = jax.lax.axis_index(AXIS)
    b, ml = local_table.shape
    page_size = pages.shape[1]
    hist = pages[local_table].reshape(b, ml * page_size, -1)  # [B, S_r, C+R]
    c, k_pe = hist[..., :kv_lora_rank], hist[..., kv_lora_rank:]
    # absolute position of local key s: logical page (s // page) * ranks + rank, offset s % page
    slot = jnp.arange(ml * page_size)
    key_pos = ((slot // page_size) * ranks + rank) * page_size + slot % page_size
    scores = (jnp.einsum("bthc,bsc->bths", q_latent, c.astype(q_latent.dtype), preferred_element_type=jnp.float32)
              + jnp.einsum("bthr,bsr->bths", q_pe, k_pe.astype(q_pe.dtype), preferred_element_type=jnp.float32)) * scale
    visible = (key_pos[None, None, :] <= query_positions[:, :, None])[:, :, None, :]  # [B, T, 1, S_r]
    m = jnp.max(jnp.where(visible, scores, _NO_KEY), axis=-1)
    p = jnp.where(visible, jnp.exp(scores - m[..., None]), 0.0)
    return m, jnp.sum(p, axis=-1), jnp.einsum("bths,bsc->bthc", p, c.astype(jnp.float32))


def merge(m, l, o):
    """Log-sum-exp merge over the ranks of partial (max, denominator, unnormalised sum) -> o_latent."""
    top = jax.lax.pmax(m, AXIS)
    w = jnp.exp(m - top)
    return jax.lax.psum(w[..., None] * o, AXIS) / jax.lax.psum(w * l, AXIS)[..., None]


def _dcp_mixer(cfg: ModelConfig, caches: dict, meta: StepMeta, local_table, kda_mode: str, ranks: int,
               backend_name: str):
    base = cached_mixer(cfg, caches, meta, kda_mode, backend_name)  # KDA layers: replicated states

    def mixer(l, p, x):
        if not cfg.is_mla(l):
            return base(l, p, x)
        j = cfg.mixer_slot[l]
        q_nope, q_pe, latent = mla.project(p, x, cfg)
        caches["kv_pages"] = _write_own_latents(caches["kv_pages"], j, latent, local_table, meta.context_lens,
                                                meta.lengths, ranks)
        w_uk, w_uv = mla.split_kv_b(p, cfg)
        q_latent = jnp.einsum("bthn,chn->bthc", q_nope, w_uk.astype(q_nope.dtype), preferred_element_type=jnp.float32)
        positions = meta.context_lens[:, None] + jnp.arange(x.shape[1])[None, :]
        m, den, o = partial_attention(q_latent.astype(x.dtype), q_pe, caches["kv_pages"][j], local_table, positions, ranks,
                                      kv_lora_rank=cfg.kv_lora_rank, scale=cfg.mla_q_head_dim**-0.5)
        attn = jnp.einsum("bthc,chv->bthv", merge(m, den, o), w_uv.astype(jnp.float32))
        return mla.output(p, attn, x, cfg)

    return mixer


def _step(params, cfg, state, tokens, meta, local_tables, mesh, kda_mode, backend_name):
    n = mesh_size(mesh)
    if local_tables.ndim != 3 or local_tables.shape[0] != n or local_tables.shape[1] != tokens.shape[0]:
        raise ValueError(f"dcp: local_tables must be [{n}, {tokens.shape[0]}, pages per rank], got {local_tables.shape}")

    def body(p, st, toks, m, table):
        caches = {"kda": st.kda, "conv": st.conv, "kv_pages": st.kv_pages}
        mixer = _dcp_mixer(cfg, caches, m, table[0], kda_mode, n, backend_name)
        hidden = run_decoder(p, cfg, embed(p, toks), mixer, None, backend_name)
        return lm_head(p, cfg, last_token_hidden(hidden, m.lengths)), DecodeState(**caches)

    replicated = jax.tree.map(lambda _: P(), params)
    meta_specs = jax.tree.map(lambda _: P(), meta)
    return jax.shard_map(body, mesh=mesh, check_vma=False,
                         in_specs=(replicated, STATE_SPECS, P(), meta_specs, P(AXIS)),
                         out_specs=(P(), STATE_SPECS))(params, state, tokens, meta, local_tables)


@partial(jax.jit, static_argnames=("cfg", "mesh", "backend_name"), donate_argnames=("state",))
def prefill(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta, local_tables: jax.Array,
            mesh: Mesh, backend_name: str = "reference"):
    """`k3jax.model.prefill` under DCP: tokens [B, T] and meta replicated (meta.page_table unused: MLA
    pages come from local_tables int32 [n, B, pages per rank]). Returns (logits float32 [B, V], new state)."""
    check_tokens(tokens, 2, "dcp.prefill")
    return _step(params, cfg, state, tokens, meta, local_tables, mesh, "chunked", backend_name)


@partial(jax.jit, static_argnames=("cfg", "mesh", "backend_name"), donate_argnames=("state",))
def decode(params, cfg: ModelConfig, state: DecodeState, tokens: jax.Array, meta: StepMeta, local_tables: jax.Array,
           mesh: Mesh, backend_name: str = "reference"):
    """`k3jax.model.decode` under DCP: tokens int32 [B] -> (logits float32 [B, V], new state)."""
    check_tokens(tokens, 1, "dcp.decode")
    return _step(params, cfg, state, tokens[:, None], meta, local_tables, mesh, "recurrent", backend_name)
