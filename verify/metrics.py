"""Numbers that compare two sets of logits or two commit streams (numpy only).

All logits are float32 ``[positions, vocab]``; reductions run in float64 so
that the metrics themselves add no error at the 1e-6 level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .protocol import CommitStream


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def logits_metrics(ref: np.ndarray, mlx: np.ndarray, tie_tolerance: float = 0.0) -> dict:
    """max/mean |Δ|, top-1 agreement, KL(ref ‖ mlx) and entropy differences.

    ``top1_tol``: top-1 agreement up to near-ties: a position also agrees when
    the MLX argmax is within ``tie_tolerance`` of the best logit under the
    reference (a flip the precision cannot decide)."""
    ref = np.asarray(ref, np.float64)
    mlx = np.asarray(mlx, np.float64)
    if ref.shape != mlx.shape:
        raise ValueError(f"logits shapes differ: reference {ref.shape}, MLX {mlx.shape}")
    diff = np.abs(ref - mlx)
    if not np.all(np.isfinite(mlx)):
        return dict(max_abs=float("inf"), mean_abs=float("inf"), top1=0.0, top1_tol=0.0, kl_mean=float("inf"),
                    kl_max=float("inf"), entropy_diff_mean=float("inf"), entropy_diff_max=float("inf"),
                    positions=int(ref.shape[0]), nonfinite=int((~np.isfinite(mlx)).sum()))
    lp_ref, lp_mlx = _log_softmax(ref), _log_softmax(mlx)
    p_ref, p_mlx = np.exp(lp_ref), np.exp(lp_mlx)
    kl = (p_ref * (lp_ref - lp_mlx)).sum(-1)
    h_ref = -(p_ref * lp_ref).sum(-1)
    h_mlx = -(p_mlx * lp_mlx).sum(-1)
    dh = np.abs(h_ref - h_mlx)
    a_ref, a_mlx = ref.argmax(-1), mlx.argmax(-1)
    rows = np.arange(ref.shape[0])
    near = ref[rows, a_mlx] >= ref[rows, a_ref] - tie_tolerance
    return dict(
        max_abs=float(diff.max()),
        mean_abs=float(diff.mean()),
        top1=float((a_ref == a_mlx).mean()),
        top1_tol=float(((a_ref == a_mlx) | near).mean()),
        kl_mean=float(np.maximum(kl, 0).mean()),
        kl_max=float(np.maximum(kl, 0).max()),
        entropy_diff_mean=float(dh.mean()),
        entropy_diff_max=float(dh.max()),
        positions=int(ref.shape[0]),
    )


def features_metrics(ref: np.ndarray, mlx: np.ndarray) -> dict:
    """Vision features ``[tokens, hidden]``: max/mean |Δ|, the cosine of each
    soft token's two vectors (worst and mean) and the relative error
    ‖Δ‖ / ‖ref‖ over the image."""
    ref = np.asarray(ref, np.float64)
    mlx = np.asarray(mlx, np.float64)
    if ref.shape != mlx.shape:
        raise ValueError(f"feature shapes differ: reference {ref.shape}, MLX {mlx.shape}")
    if not np.all(np.isfinite(mlx)):
        return dict(max_abs=float("inf"), mean_abs=float("inf"), cosine_min=0.0, cosine_mean=0.0,
                    rel_err=float("inf"), tokens=int(ref.shape[0]), nonfinite=int((~np.isfinite(mlx)).sum()))
    diff = np.abs(ref - mlx)
    norms = np.linalg.norm(ref, axis=-1) * np.linalg.norm(mlx, axis=-1)
    dots = (ref * mlx).sum(-1)
    # Two zero vectors agree; one zero vector against another does not.
    cos = np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0),
                   np.where(np.abs(ref).sum(-1) + np.abs(mlx).sum(-1) == 0, 1.0, 0.0))
    scale = np.linalg.norm(ref)
    return dict(
        max_abs=float(diff.max()) if diff.size else 0.0,
        mean_abs=float(diff.mean()) if diff.size else 0.0,
        cosine_min=float(cos.min()) if cos.size else 1.0,
        cosine_mean=float(cos.mean()) if cos.size else 1.0,
        rel_err=float(np.linalg.norm(ref - mlx) / scale) if scale > 0 else float(np.linalg.norm(mlx) > 0),
        tokens=int(ref.shape[0]),
    )


def aggregate_features(per_image: dict[str, dict]) -> dict:
    """Worst image for every error, token-weighted mean for the mean cosine."""
    rows = list(per_image.values())
    if not rows:
        return {}
    tokens = np.array([r["tokens"] for r in rows], np.float64)
    return dict(
        max_abs=max(r["max_abs"] for r in rows),
        mean_abs=float(np.average([r["mean_abs"] for r in rows], weights=tokens)) if tokens.sum() else 0.0,
        cosine_min=min(r["cosine_min"] for r in rows),
        cosine_mean=float(np.average([r["cosine_mean"] for r in rows], weights=tokens)) if tokens.sum() else 1.0,
        rel_err=max(r["rel_err"] for r in rows),
        images=len(rows),
        tokens=int(tokens.sum()),
    )


def aggregate(per_case: dict[str, dict]) -> dict:
    """Worst case over cases for errors, mean for top-1/KL (the gate is per metric)."""
    if not per_case:
        return {}
    rows = list(per_case.values())
    weights = np.array([r["positions"] for r in rows], np.float64)

    def wmean(key):
        return float(np.average([r[key] for r in rows], weights=weights))

    return dict(
        max_abs=max(r["max_abs"] for r in rows),
        mean_abs=wmean("mean_abs"),
        top1=wmean("top1"),
        top1_min=min(r["top1"] for r in rows),
        top1_tol=wmean("top1_tol"),
        kl_mean=wmean("kl_mean"),
        kl_max=max(r["kl_max"] for r in rows),
        entropy_diff_mean=wmean("entropy_diff_mean"),
        entropy_diff_max=max(r["entropy_diff_max"] for r in rows),
        cases=len(rows),
        positions=int(weights.sum()),
    )


@dataclass
class Divergence:
    """Where two commit streams first differ."""

    block: int
    step: Optional[int]  # None: the step traces agree but the commits do not
    position: int
    reference_token: int
    mlx_token: int
    # The two candidates' logits in each framework (None: not in that trace's top-K).
    reference_logits: dict
    mlx_logits: dict
    reason: str

    def near_tie(self, tolerance: float) -> bool:
        """Both frameworks see the two candidates within ``tolerance`` of each
        other: a flip the precision cannot decide, not a bug. A candidate
        missing from a trace's top-K is bounded by that trace's K-th logit."""
        if self.step is None or self.position < 0:
            return False
        a, b = str(self.reference_token), str(self.mlx_token)
        for side in (self.reference_logits, self.mlx_logits):
            x, y = side.get(a), side.get(b)
            if x is None and y is None:
                return False
            if x is None or y is None:
                present = x if x is not None else y
                floor = side.get("kth")
                if floor is None or present - floor > tolerance:
                    return False
            elif abs(x - y) > tolerance:
                return False
        return True

    def to_dict(self) -> dict:
        return dict(
            block=self.block, step=self.step, position=self.position,
            reference_token=self.reference_token, mlx_token=self.mlx_token,
            reference_logits=self.reference_logits, mlx_logits=self.mlx_logits, reason=self.reason,
        )

    @property
    def stop_decision(self) -> bool:
        """The traces agree step for step; one framework stopped earlier."""
        return self.position < 0 and self.step is not None

    def describe(self) -> str:
        if self.position < 0:
            return f"canvas {self.block}: {self.reason}"
        step = "final commit" if self.step is None else f"step {self.step + 1}"
        return (
            f"canvas {self.block}, {step}, position {self.position}: reference {self.reference_token} "
            f"(logits ref {_fmt(self.reference_logits.get(str(self.reference_token)))} / mlx "
            f"{_fmt(self.mlx_logits.get(str(self.reference_token)))}) vs MLX {self.mlx_token} "
            f"(ref {_fmt(self.reference_logits.get(str(self.mlx_token)))} / mlx "
            f"{_fmt(self.mlx_logits.get(str(self.mlx_token)))}); {self.reason}"
        )


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _candidate_logits(ids: np.ndarray, vals: np.ndarray, tokens: tuple[int, int]) -> dict:
    out = {}
    for t in tokens:
        hit = np.nonzero(ids == t)[0]
        out[str(t)] = float(vals[hit[0]]) if hit.size else None
    out["kth"] = float(vals[-1]) if len(vals) else None  # bound for a candidate outside the top-K
    return out


def first_divergence(ref: CommitStream, mlx: CommitStream) -> Optional[Divergence]:
    """First (block, step, position) where the two generations differ."""
    for b, (rb, mb) in enumerate(zip(ref.blocks, mlx.blocks)):
        steps = min(rb.steps, mb.steps)
        for s in range(steps):
            ra, ma = rb.step_argmax[s], mb.step_argmax[s]
            if ra.shape == ma.shape and not np.array_equal(ra, ma):
                p = int(np.nonzero(ra != ma)[0][0])
                pair = (int(ra[p]), int(ma[p]))
                return Divergence(
                    b, s, p, pair[0], pair[1],
                    _candidate_logits(rb.topk_ids[s, p], rb.topk_logits[s, p], pair),
                    _candidate_logits(mb.topk_ids[s, p], mb.topk_logits[s, p], pair),
                    "argmax differs at this denoising step",
                )
        if rb.steps != mb.steps:
            return Divergence(
                b, steps, -1, -1, -1, {}, {},
                f"same argmax for {steps} steps, then the reference ran {rb.steps} steps and MLX {mb.steps}",
            )
        if rb.tokens != mb.tokens:
            n = min(len(rb.tokens), len(mb.tokens))
            p = next((j for j in range(n) if rb.tokens[j] != mb.tokens[j]), n)
            rt = rb.tokens[p] if p < len(rb.tokens) else -1
            mt = mb.tokens[p] if p < len(mb.tokens) else -1
            return Divergence(b, None, p, rt, mt, {}, {}, "committed tokens differ (EOS handling?)")
    if len(ref.blocks) != len(mlx.blocks):
        b = min(len(ref.blocks), len(mlx.blocks))
        return Divergence(
            b, None, -1, -1, -1, {}, {},
            f"reference committed {len(ref.blocks)} canvases ({ref.finish_reason}), "
            f"MLX {len(mlx.blocks)} ({mlx.finish_reason})",
        )
    return None


def stream_metrics(ref: CommitStream, mlx: CommitStream) -> dict:
    """Committed-token agreement and denoising-step drift of one prompt."""
    rt, mt = ref.tokens, mlx.tokens
    n = max(len(rt), len(mt), 1)
    same = sum(1 for a, b in zip(rt, mt) if a == b)
    rs, ms = ref.steps_per_block, mlx.steps_per_block
    k = min(len(rs), len(ms))
    return dict(
        identical=rt == mt and ref.finish_reason == mlx.finish_reason,
        same_steps=rs == ms,
        # two empty streams (an immediate EOS in both) agree completely
        token_match=same / n if (rt or mt) else 1.0,
        reference_tokens=len(rt),
        mlx_tokens=len(mt),
        reference_steps=rs,
        mlx_steps=ms,
        steps_delta_mean=float(np.mean([ms[i] - rs[i] for i in range(k)])) if k else 0.0,
        reference_steps_mean=float(np.mean(rs)) if rs else 0.0,
        mlx_steps_mean=float(np.mean(ms)) if ms else 0.0,
    )


def acceptance_tie(ref: CommitStream, mlx: CommitStream, div: Divergence, tolerance: float) -> Optional[dict]:
    """Why the argmaxes of ``div``'s step differ when every earlier step's
    agreed: an earlier step kept different positions. Finds the first such
    step (from the blocks' step_accept, None when a side lacks them) and
    whether it was a near-tie: on each side, every position kept on one side
    only has a score within ``tolerance`` of a position the same side decided
    the other way (the two swap places at the acceptance cut)."""
    if div.step is None or div.position < 0 or div.block >= min(len(ref.blocks), len(mlx.blocks)):
        return None
    rb, mb = ref.blocks[div.block], mlx.blocks[div.block]
    if rb.step_accept is None or mb.step_accept is None:
        return None
    for t in range(min(div.step, len(rb.step_accept), len(mb.step_accept))):
        ra, ma = rb.step_accept[t], mb.step_accept[t]
        if ra.shape != ma.shape or np.array_equal(ra, ma):
            continue
        flipped = np.nonzero(ra != ma)[0]
        tied = True
        for scores, kept in ((rb.step_scores[t], ra), (mb.step_scores[t], ma)):
            for p in flipped:
                other = scores[kept != kept[p]]
                if not other.size or np.min(np.abs(other - scores[p])) > tolerance:
                    tied = False
        return dict(step=int(t), positions=[int(p) for p in flipped[:8]], flipped=int(flipped.size), tied=tied,
                    reference_scores=[float(rb.step_scores[t][p]) for p in flipped[:8]],
                    mlx_scores=[float(mb.step_scores[t][p]) for p in flipped[:8]])
    return None


def step_gaps(ref: CommitStream, mlx: CommitStream, div: Divergence) -> list[float]:
    """Max |Δ| of the top-1 logit (over positions whose argmax agrees) at each
    step of ``div``'s canvas up to its step: a gap that starts at the compute
    precision and grows step by step is rounding amplified through the loop's
    feedback (self-conditioning), one that starts large is not."""
    if div.step is None or div.block >= min(len(ref.blocks), len(mlx.blocks)):
        return []
    rb, mb = ref.blocks[div.block], mlx.blocks[div.block]
    gaps = []
    for s in range(min(div.step + 1, rb.steps, mb.steps)):
        same = rb.step_argmax[s] == mb.step_argmax[s]
        d = np.abs(rb.topk_logits[s][:, 0] - mb.topk_logits[s][:, 0])[same]
        gaps.append(float(d.max()) if d.size else float("nan"))
    return gaps
