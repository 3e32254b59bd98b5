"""Masked statistics over padded token tensors.

Shapes (legend used by every file in klppo.algo):
    B  batch size (sequences)
    T  response length (padded)
    V  vocabulary size

Masks are bool, True = real token (a 0/1 numeric mask is accepted and read as bool).
Every function here is sync-free: no `.item()`, no Python branch on a tensor value, so
they can run inside a compiled or CUDA-graphed step. Conventions follow verl's
`verl/utils/torch_functional.py` so that numbers match a verl run.
"""

from typing import Optional, Tuple, Union

import torch

Dim = Optional[Union[int, Tuple[int, ...]]]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Sum of `values` where `mask` is True.

    values, mask: same shape, e.g. (B, T). Returns `values` reduced over `dim` (all dims
    when None). Padded entries are replaced by 0 before summing (not multiplied by the
    mask), so a NaN or inf in padding cannot leak into the sum (as verl).
    """
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    if dim is None:
        return valid.sum()
    return valid.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Mean of `values` over entries where `mask` is True.

    values, mask: same shape. Returns `values` reduced over `dim` (all dims when None).
    The count gets + 1e-8 (verl), so an all-padding slice gives 0 instead of NaN.
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over all entries where `mask` is True; a 0-dim tensor.

    values, mask: same shape. With `unbiased` the Bessel factor n / (n - 1) is applied
    (as torch.var and verl). Unlike verl this does not raise for n <= 1 (raising would
    need a host sync): with one or no real entry the variance is 0.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.bool().sum().to(variance.dtype)
        variance = variance * n / (n - 1).clamp(min=1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise `values` to zero mean, unit variance over the masked entries.

    values, mask: same shape. Returns the same shape: (x - mean) * rsqrt(var + 1e-8) with
    the unbiased masked variance (verl's masked_whiten); with `shift_mean=False` the mean
    is added back. Padded entries are transformed too; callers zero them if needed.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
