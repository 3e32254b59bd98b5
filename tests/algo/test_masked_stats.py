"""Masked statistics: hand-worked values and the whitening contract."""

import torch

from klppo.algo import masked_mean, masked_sum, masked_var, masked_whiten

# values (2, 3) with the last column and the second row's middle token padded
VALUES = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, float("nan")]])
MASK = torch.tensor([[True, True, False], [True, False, False]])


def test_masked_sum_ignores_padding_even_when_it_is_nan():
    # real entries: 1 + 2 + 3 = 6
    assert torch.equal(masked_sum(VALUES, MASK), torch.tensor(6.0))
    # per row: [1 + 2, 3] = [3, 3]
    assert torch.equal(masked_sum(VALUES, MASK, dim=-1), torch.tensor([3.0, 3.0]))


def test_masked_mean_averages_real_entries_per_row_and_overall():
    # overall (1 + 2 + 3) / 3 = 2; per row [(1 + 2) / 2, 3 / 1] = [1.5, 3]
    assert torch.allclose(masked_mean(VALUES, MASK), torch.tensor(2.0))
    assert torch.allclose(masked_mean(VALUES, MASK, dim=-1), torch.tensor([1.5, 3.0]))


def test_masked_mean_of_an_all_padding_row_is_zero_not_nan():
    mask = torch.tensor([[True, True, False], [False, False, False]])
    out = masked_mean(VALUES, mask, dim=-1)
    assert torch.allclose(out, torch.tensor([1.5, 0.0]))


def test_masked_var_matches_torch_var_on_the_real_entries():
    # real entries [1, 2, 3]: mean 2, squared deviations 1 + 0 + 1 = 2;
    # unbiased 2 / (3 - 1) = 1, biased 2 / 3
    assert torch.allclose(masked_var(VALUES, MASK), torch.tensor(1.0))
    assert torch.allclose(masked_var(VALUES, MASK, unbiased=False), torch.tensor(2.0 / 3.0))


def test_masked_var_of_a_single_real_entry_is_zero_without_raising():
    mask = torch.tensor([[True, False, False], [False, False, False]])
    assert torch.equal(masked_var(VALUES, mask), torch.tensor(0.0))


def test_masked_whiten_gives_zero_mean_unit_variance_over_real_entries():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4, 7, generator=gen) * 3.0 + 5.0
    mask = torch.rand(4, 7, generator=gen) > 0.3
    white = masked_whiten(values, mask)
    assert torch.allclose(masked_mean(white, mask), torch.tensor(0.0), atol=1e-5)
    assert torch.allclose(masked_var(white, mask), torch.tensor(1.0), atol=1e-4)


def test_masked_whiten_without_shift_keeps_the_mean():
    # real [1, 2, 3]: mean 2, unbiased var 1 -> scaled (x - 2) * 1 + 2 = x
    white = masked_whiten(VALUES, MASK, shift_mean=False)
    assert torch.allclose(white[MASK], torch.tensor([1.0, 2.0, 3.0]), atol=1e-6)


def test_masked_stats_accept_a_numeric_zero_one_mask():
    assert torch.allclose(masked_mean(VALUES, MASK.float()), masked_mean(VALUES, MASK))
