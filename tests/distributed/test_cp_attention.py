"""Context-parallel attention (ring, Ulysses, hybrid) against one-process attention.

Each rank holds the head-tail shard of a sequence of S = 64 tokens (B = 2 rows, H = 4 query
heads, d = 8) and runs :func:`engine.context_parallel.attention.attention_with_lse`; the
output, the log-sum-exp and dq, dk, dv (for a random output gradient) are compared with the
same shard of one-process attention on the whole sequence. Cases, all in one process group
per (mode, CP size): fp32 / fp64 / bf16 inputs, causal / document-causal (random document
lengths per row: one of 3 tokens, shorter than the CP 4 chunk of 8, and one of S/C + 5,
longer than a rank's shard, then random lengths in [1, 30]), KV heads 1, 2 and H.

Tolerances: fp32 within 2e-6 absolute of one-process SDPA (fp32 summation order only: the
blocks merge by their log-sum-exp in fp32); fp64 within 1e-12. The lse reference is the
fp64 logsumexp of the masked scores. bf16 inputs: the error of the output and of each
gradient against an fp64 reference (computed from the same bf16 values) is at most 1.5x
that of one-process bf16 SDPA (the CP path computes and merges in fp32 and rounds once).
The document mask is checked to matter (the causal-only output differs by > 1e-2), so a
mode that ignored doc_ids fails.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

B, H, S, D = 2, 4, 64, 8
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
TOL = {"fp32": 2e-6, "fp64": 1e-12}


def _doc_ids(g: torch.Generator, cp: int) -> torch.Tensor:
    """(B, S) document ids: per row a 3-token document, one of S/C + 5 tokens, then random."""
    rows = []
    for _ in range(B):
        lengths = [3, S // cp + 5]
        if torch.rand(1, generator=g).item() < 0.5:
            lengths.reverse()
        while sum(lengths) < S:
            lengths.append(int(torch.randint(1, 31, (1,), generator=g)))
        rows.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[:S])
    return torch.stack(rows)


def _mask(doc: torch.Tensor | None) -> torch.Tensor:
    pos = torch.arange(S)
    m = (pos[None, :, None] >= pos[None, None, :]).expand(B, S, S)
    if doc is not None:
        m = m & (doc[:, :, None] == doc[:, None, :])
    return m[:, None]                                                        # (B, 1, S, S)


def _reference(q, k, v, do, mask):
    """One-process SDPA output and grads (in the inputs' dtype) and the fp64 lse."""
    import torch.nn.functional as F

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    grads = torch.autograd.grad(o, (q, k, v), do)
    rep = H // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(rep, 1).transpose(-1, -2)) * D ** -0.5
    lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), dim=-1)
    return o.detach(), grads, lse


def _layout(mode: str, cp: int, u: int, rank: int):
    """Ulysses groups: runs of u consecutive ranks; ring groups: one rank of each."""
    import torch.distributed as dist

    from engine.context_parallel import CPLayout
    from engine.distributed.groups import AxisGroup

    r = cp // u
    uly_groups = [dist.new_group(list(range(j * u, (j + 1) * u))) if u > 1 else None for j in range(r)]
    ring_groups = [dist.new_group(list(range(i, cp, u))) if r > 1 else None for i in range(u)]
    uly = uly_groups[rank // u]
    ring = ring_groups[rank % u]
    return CPLayout(mode, cp, rank, u,
                    AxisGroup.of(ring, "cp_ring") if ring is not None else (AxisGroup.single("cp_ring", rank)
                                                                             if mode != "ulysses" else None),
                    AxisGroup.of(uly, "cp_ulysses") if uly is not None else None)


def _run_cases(rank, world, mode, u):
    from engine.context_parallel import shard_sequence
    from engine.context_parallel.attention import attention_with_lse

    layout = _layout(mode, world, u, rank)
    out = {}
    for dname, dtype in DTYPES.items():
        for nkv in (1, 2, H):
            for masking in ("causal", "doc"):
                g = torch.Generator().manual_seed(1000 * nkv + (7 if masking == "doc" else 0))
                q, k, v, do = (torch.randn(B, n, S, D, generator=g, dtype=torch.float64)
                               for n in (H, nkv, nkv, H))
                doc = _doc_ids(g, world) if masking == "doc" else None
                q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
                mask = _mask(doc)

                def shard(t):
                    return shard_sequence(t, world, rank, dim=2 if t.dim() >= 3 else 1)

                ql, kl, vl = (shard(t).detach().requires_grad_() for t in (q, k, v))
                pos = shard(torch.arange(S).expand(B, S))
                ol, lse = attention_with_lse(ql, kl, vl, layout, positions=pos,
                                             doc_ids=None if doc is None else shard(doc))
                grads = torch.autograd.grad(ol, (ql, kl, vl), shard(do))
                mine = (ol.detach(), *grads)
                names = ("o", "dq", "dk", "dv")
                if dname == "bf16":
                    ref64, g64, _ = _reference(q.double(), k.double(), v.double(), do.double(), mask)
                    ref16, g16, _ = _reference(q, k, v, do, mask)
                    full64, full16 = (ref64, *g64), (ref16, *g16)
                    err = {n: (a.double() - shard(b)).abs().max().item() for n, a, b in zip(names, mine, full64)}
                    base = {n: (a.double() - b).abs().max().item() for n, a, b in zip(names, full16, full64)}
                    out[(dname, nkv, masking)] = {"err": err, "sdpa_err": base}
                    continue
                ref, gref, lse_ref = _reference(q, k, v, do, mask)
                err = {n: (a - shard(b)).abs().max().item() for n, a, b in zip(names, mine, (ref, *gref))}
                err["lse"] = (lse.double() - shard(lse_ref)).abs().max().item()
                if doc is not None:   # the document mask changes the answer: a mode ignoring it fails
                    causal = _reference(q, k, v, do, _mask(None))[0]
                    err["doc_effect"] = (shard(causal) - shard(ref)).abs().max().item()
                out[(dname, nkv, masking)] = {"err": err}
    return out


def _check(results):
    for key in results[0]:
        if key[0] == "bf16":
            for n in ("o", "dq", "dk", "dv"):
                mine = max(r[key]["err"][n] for r in results)
                base = results[0][key]["sdpa_err"][n]
                assert mine <= 1.5 * base, f"{key} {n}: CP error {mine:.3g} > 1.5 x one-process bf16 SDPA {base:.3g}"
            continue
        for n in ("o", "lse", "dq", "dk", "dv"):
            worst = max(r[key]["err"][n] for r in results)
            assert worst <= TOL[key[0]], f"{key} {n}: {worst:.3g} > {TOL[key[0]]}"
        if key[2] == "doc":
            assert max(r[key]["err"]["doc_effect"] for r in results) > 1e-2


@pytest.mark.parametrize("mode,cp,u", [("ring", 2, 1), ("ring", 4, 1), ("ulysses", 2, 2), ("ulysses", 4, 4),
                                       ("hybrid", 2, 2), ("hybrid", 4, 2)])
def test_cp_attention_matches_one_process(mode, cp, u):
    _check(run_ranks(_run_cases, cp, mode, u, timeout=300))
