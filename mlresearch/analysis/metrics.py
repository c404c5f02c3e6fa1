"""Similarity metrics between feature maps and attention maps.

- ``cosine``: cosine similarity of flattened maps.
- Linear CKA (Kornblith et al., 2019): ``HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L))`` with linear
  kernels ``K = X X^T``, ``L = Y Y^T`` over n examples. The *biased* HSIC is
  ``tr(K H L H) / (n-1)^2`` (H centres); it is inflated for small n, so independent features still
  look similar. The *unbiased* HSIC (Song et al., 2012) zeroes the kernels' diagonals:

      HSIC_u = [tr(K~ L~) + 1^T K~ 1 * 1^T L~ 1 / ((n-1)(n-2)) - 2/(n-2) * 1^T K~ L~ 1] / (n (n-3))

  and can be negative; CKA from it is clipped to [-1, 1] and a non-positive denominator gives 0,
  never NaN.
- Minibatch CKA (Nguyen et al., 2021): average the unbiased HSIC terms over batches, then form CKA.
- Attention distributions: Jensen-Shannon divergence between rows of two attention maps (in
  nats, 0 to ln 2), ignoring masked query rows.
"""

from __future__ import annotations

import torch


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).double()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    denom = a.norm() * b.norm()
    return float(a @ b / denom) if denom > 0 else 0.0


def gram(x: torch.Tensor) -> torch.Tensor:
    x = _flat(x)
    return x @ x.T


def hsic_biased(k: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    n = k.shape[0]
    h = torch.eye(n, dtype=k.dtype, device=k.device) - 1.0 / n
    return torch.trace(k @ h @ l @ h) / (n - 1) ** 2


def hsic_unbiased(k: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    n = k.shape[0]
    if n < 4:
        raise ValueError(f"unbiased HSIC needs at least 4 examples, got {n}")
    k = k.clone().fill_diagonal_(0)
    l = l.clone().fill_diagonal_(0)
    ones = torch.ones(n, dtype=k.dtype, device=k.device)
    term1 = torch.sum(k * l)  # tr(K L) for symmetric matrices
    term2 = (ones @ k @ ones) * (ones @ l @ ones) / ((n - 1) * (n - 2))
    term3 = 2.0 / (n - 2) * (ones @ k @ l @ ones)
    return (term1 + term2 - term3) / (n * (n - 3))


def _cka_from(hxy, hxx, hyy) -> float:
    denom = hxx * hyy
    if not torch.isfinite(denom) or denom <= 0:
        return 0.0
    return float(torch.clamp(hxy / torch.sqrt(denom), -1.0, 1.0))


def _hsic_features(x: torch.Tensor, y: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """HSIC of the linear kernels X X^T, Y Y^T computed in feature space: O(n d1 d2), not O(n^3).

    Biased: ||Yc^T Xc||_F^2 / (n-1)^2 with centred features. Unbiased: the same terms as
    :func:`hsic_unbiased`, using tr(K~ L~) = ||X^T Y||^2 - sum_i |x_i|^2 |y_i|^2,
    1^T K~ 1 = |sum_i x_i|^2 - sum_i |x_i|^2 and (K~ 1)_i = x_i . sum_j x_j - |x_i|^2.
    """
    n = x.shape[0]
    if not unbiased:
        xc, yc = x - x.mean(0), y - y.mean(0)
        return (yc.T @ xc).pow(2).sum() / (n - 1) ** 2
    if n < 4:
        raise ValueError(f"unbiased HSIC needs at least 4 examples, got {n}")
    nx, ny = x.pow(2).sum(1), y.pow(2).sum(1)
    sx, sy = x.sum(0), y.sum(0)
    k1, l1 = x @ sx - nx, y @ sy - ny
    term1 = (x.T @ y).pow(2).sum() - (nx * ny).sum()
    term2 = (sx @ sx - nx.sum()) * (sy @ sy - ny.sum()) / ((n - 1) * (n - 2))
    term3 = 2.0 / (n - 2) * (k1 @ l1)
    return (term1 + term2 - term3) / (n * (n - 3))


def linear_cka(x: torch.Tensor, y: torch.Tensor, unbiased: bool = False) -> float:
    """Linear CKA of two feature matrices with the same first (example) dimension."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA needs the same examples: {x.shape[0]} vs {y.shape[0]}")
    x, y = _flat(x), _flat(y)
    if x.shape[1] + y.shape[1] > 2 * x.shape[0]:  # wide features: the n x n kernel form is cheaper
        k, l = gram(x), gram(y)
        hsic = hsic_unbiased if unbiased else hsic_biased
        return _cka_from(hsic(k, l), hsic(k, k), hsic(l, l))
    return _cka_from(_hsic_features(x, y, unbiased), _hsic_features(x, x, unbiased), _hsic_features(y, y, unbiased))


class MinibatchCKA:
    """Accumulates unbiased HSIC terms for every pair of ``m`` feature sets over batches."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.sums = torch.zeros(m, m, dtype=torch.float64)
        self.batches = 0

    def update(self, features: list[torch.Tensor]) -> None:
        if len(features) != self.m:
            raise ValueError(f"expected {self.m} feature sets, got {len(features)}")
        grams = [gram(f) for f in features]
        for i in range(self.m):
            for j in range(i, self.m):
                self.sums[i, j] += hsic_unbiased(grams[i], grams[j]).cpu()
        self.batches += 1

    def compute(self) -> torch.Tensor:
        if not self.batches:
            raise ValueError("no batches accumulated")
        h = torch.triu(self.sums) + torch.triu(self.sums, 1).T
        out = torch.zeros(self.m, self.m, dtype=torch.float64)
        for i in range(self.m):
            for j in range(self.m):
                out[i, j] = _cka_from(h[i, j], h[i, i], h[j, j])
        return out


def js_divergence(p: torch.Tensor, q: torch.Tensor, row_mask: torch.Tensor | None = None) -> float:
    """Mean Jensen-Shannon divergence between matching rows (last dim = distribution)."""
    p, q = p.double(), q.double()
    m = 0.5 * (p + q)

    def kl(a, b):
        return torch.where(a > 0, a * (torch.log(a.clamp_min(1e-300)) - torch.log(b.clamp_min(1e-300))), 0.0).sum(-1)

    js = 0.5 * kl(p, m) + 0.5 * kl(q, m)
    if row_mask is not None:
        js = js[row_mask.expand_as(js)]
    return float(js.mean())


def pairwise(items: list[torch.Tensor], fn) -> torch.Tensor:
    """The symmetric matrix ``fn(items[i], items[j])``."""
    n = len(items)
    out = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(i, n):
            out[i, j] = out[j, i] = fn(items[i], items[j])
    return out
