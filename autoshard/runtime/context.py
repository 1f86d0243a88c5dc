"""Context parallelism at run time: attention over a sequence sharded on one mesh axis, and the head-tail layout.

A rank of a group of ``n`` on the context axis holds a contiguous *chunk* of the sequence (``n`` chunks of
``S/n``), or, load-balanced for causal masks, two chunks ``r`` and ``2n-1-r`` of ``S/2n`` (head-tail: every rank
then has as many unmasked query-key pairs as any other). :func:`chunks_of` says which; the chunks of a local tensor
are concatenated in that order along the sequence dim.

Three local forms of ``scaled_dot_product_attention`` over sequence-sharded ``q, k, v`` (``[..., heads, seq/n,
d]``), each a ``torch.library`` op with its own backward (``torch.compile`` sees one opaque node):

======================  =================================================  =====================================
form                    forward                                            backward
======================  =================================================  =====================================
``ring``                K/V passed around the axis, n-1 steps (one send   K/V around the ring again; dK/dV travel
                        of K and one of V each); partial outputs merged    with them (n-1 steps), then added to
                        by their log-sum-exp (online softmax)              the owner's own share
``all_gather``          K and V all-gathered, the local Q attends to all  K/V gathered again; dK/dV
                                                                           reduce-scattered to their owners
``ulysses``             all-to-all seq → heads for q, k, v (heads must    the inverse all-to-alls around the
                        divide by n), full-sequence attention on heads/n,  local backward
                        all-to-all back
======================  =================================================  =====================================

Only the local Q, K, V, the output and its log-sum-exp are saved for backward (the gathered K/V of ``all_gather``
are gathered again), so attention's saved activations per rank are 1/n of one device's. The attention of one
block is computed on chunk pairs (:func:`_attend`): with a causal mask, pairs wholly in the future are skipped —
which is what head-tail balancing evens out across ranks. A boolean or additive ``mask`` holds this rank's query
rows and every key column in natural order (it is sliced per key chunk), so any mask (sliding window, documents)
is exact. GQA (fewer K/V heads dividing the query heads) repeats K/V heads inside the block and sums their
gradients back.
"""

from __future__ import annotations

import contextlib
import math

import torch

from autoshard.errors import PlanError
from autoshard.runtime.primitives import AUTOCAST_LOWER, define_op, keep_comm
from autoshard.runtime.communicator import current, use

__all__ = ["FORMS", "chunks_of", "context_attention", "head_tail", "head_tail_order", "head_tail_slice",
           "sequence_slice"]

FORMS = ("ring", "all_gather", "ulysses")


def chunks_of(index: int, n: int, balanced: bool) -> list[int]:
    """The sequence chunks coordinate ``index`` of ``n`` holds: ``[index]`` of ``n`` chunks, or ``[index,
    2n-1-index]`` of ``2n`` (head-tail)."""
    return [index, 2 * n - 1 - index] if balanced else [index]


def head_tail_order(length: int, n: int) -> torch.Tensor:
    """Positions ``0..length-1`` in head-tail order: coordinate 0's two chunks, then coordinate 1's, ..."""
    c = length // (2 * n)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for i in range(n) for k in chunks_of(i, n, True)])


def head_tail(x: torch.Tensor, dim: int, n: int, inverse: bool) -> torch.Tensor:
    """``x`` reordered along ``dim`` from natural to head-tail order (``inverse``: back). A contiguous chunk ``i``
    of the head-tail order is then coordinate ``i``'s share, so a plain slice, gather or reduce-scatter of the
    reordered tensor is the balanced one. An index_select: autograd scatters the gradient back."""
    length = x.shape[dim]
    if length % (2 * n):
        raise PlanError(f"head-tail load balancing on an axis of size {n} splits dim {dim} of shape {list(x.shape)}"
                        f" into {2 * n} chunks, but {length} is not divisible by {2 * n}. Use a sequence length "
                        "divisible by twice the context axis, or context_axis=ContextParallel(..., balance=False).")
    order = head_tail_order(length, n).to(x.device)
    if inverse:
        order = torch.argsort(order)
    return x.index_select(dim, order)


def head_tail_slice(x: torch.Tensor, axis: str, dim: int, size: int) -> torch.Tensor:
    """This rank's head-tail share of a whole tensor: chunks ``r`` and ``2n-1-r`` of ``2n`` along ``dim``."""
    r = current().axis_index(axis)
    c = x.shape[dim] // (2 * size)
    return torch.cat([x.narrow(dim, k * c, c) for k in chunks_of(r, size, True)], dim=dim)


# ---- the block kernel: attention of query chunks against key chunks ---------------------------------------
def _pair_mask(mask, causal: bool, qk: int, kk: int, qi: int, c: int, device):
    """The mask of query chunk ``qk`` (rows ``qi*c..`` of the local ``mask``) against key chunk ``kk`` (columns
    ``kk*c..``): None (all visible), False (all hidden: the pair is skipped) or a tensor."""
    if causal and kk > qk:
        return False
    tri = torch.ones(c, c, dtype=torch.bool, device=device).tril() if causal and kk == qk else None
    if mask is None:
        return tri
    m = mask[..., qi * c:(qi + 1) * c, kk * c:(kk + 1) * c]
    if m.dtype == torch.bool and not bool(m.any()):
        return False
    if tri is None:
        return m
    return m & tri if m.dtype == torch.bool else m.masked_fill(~tri, float("-inf"))


def _scores(q, k, scale, m):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if m is None:
        return s
    if m.dtype == torch.bool:
        return s.masked_fill(~m.to(s.device), float("-inf"))
    return s + m.to(s.dtype)


def _f(t: torch.Tensor) -> torch.Tensor:
    """The accumulation dtype: float64 stays, anything else computes in float32."""
    return t if t.dtype == torch.float64 else t.float()


def _expand_kv(k, heads: int):
    g = heads // k.shape[-3]
    return k if g == 1 else k.repeat_interleave(g, dim=-3)


def _fold_kv(dk, kv_heads: int):
    g = dk.shape[-3] // kv_heads
    if g == 1:
        return dk
    return dk.unflatten(-3, (kv_heads, g)).sum(-3)


def _safe_exp_diff(a, b):
    """exp(a - b) with 0 where ``b`` is -inf (a row that sees no key)."""
    return torch.where(torch.isinf(b), torch.zeros_like(a), torch.exp(a - b))


def _attend(acc, q, qchunks, k, v, kchunks, mask, causal, scale):
    """Merge into ``acc`` (per query chunk: [out, lse]) the attention of ``q``'s chunks against the key chunks
    ``kchunks`` of ``k, v``. ``mask``: rows of ``q``, columns of the whole sequence (natural order)."""
    c = q.shape[-2] // len(qchunks)
    heads = q.shape[-3]
    for qi, qk in enumerate(qchunks):
        qc = q[..., qi * c:(qi + 1) * c, :]
        for ki, kk in enumerate(kchunks):
            m = _pair_mask(mask, causal, qk, kk, qi, c, q.device)
            if m is False:
                continue
            kc = _expand_kv(k[..., ki * c:(ki + 1) * c, :], heads)
            vc = _expand_kv(v[..., ki * c:(ki + 1) * c, :], heads)
            s = _scores(qc, kc, scale, m)
            lse_b = torch.logsumexp(s, dim=-1)
            p = _safe_exp_diff(s, lse_b.unsqueeze(-1))
            out_b = torch.matmul(p, vc)
            out, lse = acc[qi]
            new = torch.logaddexp(lse, lse_b)
            acc[qi] = [out * _safe_exp_diff(lse, new).unsqueeze(-1) + out_b * _safe_exp_diff(lse_b, new).unsqueeze(-1),
                       new]


def _new_acc(q, qchunks):
    c = q.shape[-2] // len(qchunks)
    shape = q.shape[:-2] + (c,)
    return [[q.new_zeros(shape + (q.shape[-1],)), q.new_full(shape, float("-inf"))] for _ in qchunks]


def _finish(acc):
    out = torch.cat([a[0] for a in acc], dim=-2)
    lse = torch.cat([a[1] for a in acc], dim=-1)
    return out, lse


def _attend_backward(grads, q, qchunks, k, v, kchunks, mask, causal, scale, dout, lse, delta):
    """Add to ``grads = [dq, dk, dv]`` (dk, dv of this ``k, v`` block) the gradients of the chunk pairs."""
    c = q.shape[-2] // len(qchunks)
    heads, kv_heads = q.shape[-3], k.shape[-3]
    dq, dk, dv = grads
    for qi, qk in enumerate(qchunks):
        rows = slice(qi * c, (qi + 1) * c)
        qc, doc = q[..., rows, :], dout[..., rows, :]
        lc, dc = lse[..., rows].unsqueeze(-1), delta[..., rows].unsqueeze(-1)
        for ki, kk in enumerate(kchunks):
            m = _pair_mask(mask, causal, qk, kk, qi, c, q.device)
            if m is False:
                continue
            cols = slice(ki * c, (ki + 1) * c)
            kc, vc = _expand_kv(k[..., cols, :], heads), _expand_kv(v[..., cols, :], heads)
            p = _safe_exp_diff(_scores(qc, kc, scale, m), lc)
            dv[..., cols, :] += _fold_kv(torch.matmul(p.transpose(-1, -2), doc), kv_heads)
            ds = p * (torch.matmul(doc, vc.transpose(-1, -2)) - dc)
            dq[..., rows, :] += torch.matmul(ds, kc) * scale
            dk[..., cols, :] += _fold_kv(torch.matmul(ds.transpose(-1, -2), qc), kv_heads) * scale


# ---- moving blocks around the axis ------------------------------------------------------------------------
def _shift(x: torch.Tensor, axis: str, phase: str) -> torch.Tensor:
    """``x`` of the previous coordinate on ``axis`` (this rank's goes to the next): one send and one recv. Even
    coordinates send first, odd ones receive first, so blocking sends (gloo) never wait on each other in a
    cycle."""
    comm = current()
    group, i, n = comm.group(axis), comm.axis_index(axis), comm.axis_size(axis)
    nxt, prv = group[(i + 1) % n], group[(i - 1) % n]
    x = x.contiguous()
    if i % 2 == 0:
        comm.send(x, nxt, phase=phase)
        return comm.recv(x.shape, x.dtype, prv, phase=phase)
    out = comm.recv(x.shape, x.dtype, prv, phase=phase)
    comm.send(x, nxt, phase=phase)
    return out


def _all_chunks(n: int, balanced: bool) -> list[int]:
    return [k for i in range(n) for k in chunks_of(i, n, balanced)]


def _heads_to_front(x: torch.Tensor, axis: str, phase: str) -> torch.Tensor:
    """Sequence-sharded ``[..., h, s/n, d]`` → head-sharded ``[..., h/n, s, d]`` (sequence in coordinate order)."""
    return current().all_to_all(x, axis, x.dim() - 3, x.dim() - 2, phase=phase)


def _seq_to_front(x: torch.Tensor, axis: str, phase: str) -> torch.Tensor:
    return current().all_to_all(x, axis, x.dim() - 2, x.dim() - 3, phase=phase)


def _rows_of_all(mask, axis: str, n: int, phase: str):
    """Ulysses: the mask rows of every coordinate (for this rank's heads)."""
    if mask is None:
        return None
    if mask.dim() >= 3 and mask.shape[-3] > 1:
        return current().all_to_all(mask, axis, mask.dim() - 3, mask.dim() - 2, phase=phase)
    return current().all_gather(mask, axis, mask.dim() - 2, phase=phase)


# ---- the op -----------------------------------------------------------------------------------------------
def _forward(q, k, v, mask, axis, size, form, causal, balanced, scale):
    comm = current()
    r = comm.axis_index(axis)
    mine = chunks_of(r, size, balanced)
    if form == "ulysses":
        qh, kh, vh = (_heads_to_front(t, axis, "forward") for t in (q, k, v))
        every = _all_chunks(size, balanced)
        acc = _new_acc(_f(qh), every)
        _attend(acc, _f(qh), every, _f(kh), _f(vh), every, _rows_of_all(mask, axis, size, "forward"),
                causal, scale)
        out_h, lse_h = _finish(acc)
        out = _seq_to_front(out_h.to(q.dtype), axis, "forward")
        return out, _seq_to_front(lse_h.unsqueeze(-1), axis, "forward").squeeze(-1)
    qf = _f(q)
    acc = _new_acc(qf, mine)
    if form == "all_gather":
        kg = comm.all_gather(k, axis, k.dim() - 2, phase="forward").to(_f(q).dtype)
        vg = comm.all_gather(v, axis, v.dim() - 2, phase="forward").to(_f(q).dtype)
        _attend(acc, qf, mine, kg, vg, _all_chunks(size, balanced), mask, causal, scale)
    else:
        kb, vb = k, v
        for t in range(size):
            if t:
                kb, vb = _shift(kb, axis, "forward"), _shift(vb, axis, "forward")
            _attend(acc, qf, mine, _f(kb), _f(vb), chunks_of((r - t) % size, size, balanced), mask, causal,
                    scale)
    out, lse = _finish(acc)
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, mask, out, lse, axis, size, form, causal, balanced, scale):
    comm = current()
    r = comm.axis_index(axis)
    mine = chunks_of(r, size, balanced)
    if form == "ulysses":
        qh, kh, vh, oh, doh = (_heads_to_front(t, axis, "backward") for t in (q, k, v, out, dout))
        lh = _heads_to_front(lse.unsqueeze(-1), axis, "backward").squeeze(-1)
        every = _all_chunks(size, balanced)
        dof = _f(doh)
        grads = [torch.zeros_like(qh, dtype=_f(q).dtype), torch.zeros_like(kh, dtype=_f(q).dtype),
                 torch.zeros_like(vh, dtype=_f(q).dtype)]
        _attend_backward(grads, _f(qh), every, _f(kh), _f(vh), every,
                         _rows_of_all(mask, axis, size, "backward"), causal, scale, dof, lh,
                         (dof * _f(oh)).sum(-1))
        return tuple(_seq_to_front(g.to(t.dtype), axis, "backward") for g, t in zip(grads, (q, k, v)))
    qf, dof = _f(q), _f(dout)
    delta = (dof * _f(out)).sum(-1)
    dq = torch.zeros_like(qf)
    if form == "all_gather":
        kg = comm.all_gather(k, axis, k.dim() - 2, phase="backward").to(_f(q).dtype)
        vg = comm.all_gather(v, axis, v.dim() - 2, phase="backward").to(_f(q).dtype)
        grads = [dq, torch.zeros_like(kg), torch.zeros_like(vg)]
        _attend_backward(grads, qf, mine, kg, vg, _all_chunks(size, balanced), mask, causal, scale, dof, lse, delta)
        dk = comm.reduce_scatter(grads[1], axis, k.dim() - 2, phase="backward")
        dv = comm.reduce_scatter(grads[2], axis, v.dim() - 2, phase="backward")
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    # ring: this rank's share of its own block's dK/dV stays here; the block of coordinate r-t picks up the shares
    # of coordinates r-t+1 .. r-1 on its way round (it travels with K/V) and comes home after the last step.
    own = [dq, torch.zeros_like(k, dtype=_f(q).dtype), torch.zeros_like(v, dtype=_f(q).dtype)]
    _attend_backward(own, qf, mine, _f(k), _f(v), mine, mask, causal, scale, dof, lse, delta)
    kb, vb, travel = k, v, None
    for t in range(1, size):
        kb, vb = _shift(kb, axis, "backward"), _shift(vb, axis, "backward")
        if travel is not None:
            travel = [_shift(travel[0], axis, "backward"), _shift(travel[1], axis, "backward")]
        else:
            travel = [torch.zeros_like(k, dtype=_f(q).dtype), torch.zeros_like(v, dtype=_f(q).dtype)]
        grads = [dq, *travel]
        _attend_backward(grads, qf, mine, _f(kb), _f(vb), chunks_of((r - t) % size, size, balanced), mask,
                         causal, scale, dof, lse, delta)
        travel = grads[1:]
    dk, dv = own[1], own[2]
    if travel is not None:
        dk = dk + _shift(travel[0], axis, "backward")
        dv = dv + _shift(travel[1], axis, "backward")
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_SIG = "str axis, int size, str form, bool causal, bool balanced, float scale"


# Under torch.autocast the op is cast as the scaled_dot_product_attention it stands for (autocast's lower-precision
# list): q, k, v and a floating mask to the autocast dtype, then the op runs with autocast off -- the softmax and
# products accumulated in float32 inside, as the fused kernels do, the output in the inputs' dtype, the log-sum-exp
# float32. Its backward runs in the saved tensors' dtypes, autocast off as well (the engine keeps autocast on in a
# backward called inside the region, which would round the float32 accumulation to bf16).
@define_op("context_attention", f"(Tensor q, Tensor k, Tensor v, Tensor? mask, {_SIG}) -> (Tensor, Tensor)",
           autocast=AUTOCAST_LOWER)
def _context_attention(q, k, v, mask, axis, size, form, causal, balanced, scale):
    """(output, log-sum-exp) of attention over ``q, k, v`` sharded along the sequence on ``axis``."""
    return _forward(q, k, v, mask, axis, size, form, causal, balanced, scale)


@_context_attention.register_fake
def _(q, k, v, mask, axis, size, form, causal, balanced, scale):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],)), q.new_empty(q.shape[:-1], dtype=_f(q).dtype)


@define_op("_context_attention_backward", f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, "
                                    f"Tensor lse, {_SIG}) -> (Tensor, Tensor, Tensor)")
def _context_attention_backward(dout, q, k, v, mask, out, lse, axis, size, form, causal, balanced, scale):
    return _backward(dout, q, k, v, mask, out, lse, axis, size, form, causal, balanced, scale)


@_context_attention_backward.register_fake
def _(dout, q, k, v, mask, out, lse, axis, size, form, causal, balanced, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    keep_comm(ctx)
    q, k, v, mask, *rest = inputs
    ctx.save_for_backward(q, k, v, mask, *output)
    ctx.rest = tuple(rest)


def _grad(ctx, dout, _dlse):
    q, k, v, mask, out, lse = ctx.saved_tensors
    comm = getattr(ctx, "comm", None)
    with contextlib.ExitStack() as stack:
        if comm is not None and not torch.compiler.is_compiling():
            stack.enter_context(use(comm))
        if torch.is_autocast_enabled(q.device.type):
            stack.enter_context(torch.autocast(q.device.type, enabled=False))
        dq, dk, dv = _context_attention_backward(dout.contiguous(), q, k, v, mask, out, lse, *ctx.rest)
    return dq, dk, dv, None, None, None, None, None, None, None


_context_attention.register_autograd(_grad, setup_context=_setup)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, axis: str,
                      size: int, form: str = "ring", causal: bool = False, balanced: bool = False,
                      scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=scale)`` of the whole sequence, for
    ``q, k, v`` sharded along dim -2 on ``axis`` (``size`` ranks; ``balanced``: head-tail chunks) and ``mask``
    holding this rank's query rows and every key column. ``form``: one of :data:`FORMS`."""
    if form not in FORMS:
        raise PlanError(f"context attention form is {form!r}, but it is one of {FORMS}.")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return torch.ops.autoshard.context_attention(q, k, v, mask, axis, size, form, bool(causal), bool(balanced),
                                                 scale)[0]


def sequence_slice(x: torch.Tensor, axis: str, dim: int, size: int, balanced: bool) -> torch.Tensor:
    """This rank's share of a whole input along ``dim`` on ``axis``: chunk ``r`` of ``size``, or (``balanced``)
    chunks ``r`` and ``2·size-1-r`` of ``2·size``. A copy (no communication; the input gets no gradient)."""
    if balanced:
        if x.shape[dim] % (2 * size):
            raise PlanError(f"an input of shape {list(x.shape)} is cut head-tail along dim {dim} on axis `{axis}` of "
                            f"size {size}, but {x.shape[dim]} is not divisible by {2 * size}.")
        return head_tail_slice(x, axis, dim, size).clone()
    c = x.shape[dim] // size
    return x.narrow(dim, current().axis_index(axis) * c, c).clone()
