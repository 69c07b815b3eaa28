"""Cost per million tokens and the self-hosting break-even volume (exact expected values)."""

from __future__ import annotations

import pytest

from bench.cost import (
    HOURS_PER_MONTH,
    Pricing,
    break_even_tokens_per_month,
    cost_figures,
    monthly_capacity_tokens,
    usd_per_million_tokens,
)


def test_usd_per_million_tokens() -> None:
    # $8/h at 1000 tok/s: 3.6 M tokens an hour -> 8 / 3.6 $/M
    assert usd_per_million_tokens(8.0, 1000.0) == pytest.approx(8.0 / 3.6, rel=1e-12)
    # $0.36/h at 100 tok/s: 0.36 M tokens an hour -> $1/M
    assert usd_per_million_tokens(0.36, 100.0) == pytest.approx(1.0, rel=1e-12)
    with pytest.raises(ValueError):
        usd_per_million_tokens(1.0, 0.0)


def test_break_even_volume() -> None:
    # $5840 a month against $10 per M output tokens: 584 M tokens a month
    assert break_even_tokens_per_month(5840.0, 10.0) == pytest.approx(584e6, rel=1e-12)
    # input billed too: 2 input tokens per output token at $1/M -> $12 per M output tokens
    assert break_even_tokens_per_month(5840.0, 10.0, 1.0, 2.0) == pytest.approx(5840.0 / 12e-6, rel=1e-12)
    with pytest.raises(ValueError):
        break_even_tokens_per_month(100.0, 0.0)


def test_cost_figures_for_a_gpu_deployment() -> None:
    pricing = Pricing(device_hour_usd=2.0, num_devices=4, device_kind="gpu",
                      api_output_usd_per_m=10.0, api_input_usd_per_m=1.0)
    assert pricing.hourly_usd == 8.0
    assert pricing.monthly_usd == 8.0 * HOURS_PER_MONTH == 5840.0
    figures = cost_figures(pricing, output_tokens_per_s=1000.0, input_tokens_per_s=2000.0)
    assert figures.usd_per_m_output_tokens == pytest.approx(8.0 / 3.6, rel=1e-12)
    assert figures.usd_per_m_input_tokens == pytest.approx(8.0 / 7.2, rel=1e-12)
    assert figures.monthly_cost_usd == 5840.0
    assert figures.monthly_capacity_output_tokens == pytest.approx(1000.0 * 3600 * 730, rel=1e-12)
    assert figures.break_even_output_tokens_per_month == pytest.approx(5840.0 / 12e-6, rel=1e-12)
    assert figures.self_hosting_can_win  # 487 M < 2628 M tokens a month


def test_break_even_beyond_capacity_means_the_api_wins() -> None:
    # $0.09/h at 10 tok/s is $2.50 per M output tokens, dearer than a $1/M API
    pricing = Pricing(device_hour_usd=0.045, num_devices=2, device_kind="cpu-core",
                      api_output_usd_per_m=1.0)
    figures = cost_figures(pricing, output_tokens_per_s=10.0, input_tokens_per_s=10.0)
    assert figures.usd_per_m_output_tokens == pytest.approx(2.5, rel=1e-12)
    assert figures.break_even_output_tokens_per_month == pytest.approx(0.09 * 730 / 1e-6, rel=1e-12)
    assert monthly_capacity_tokens(10.0) == pytest.approx(26.28e6, rel=1e-12)
    assert not figures.self_hosting_can_win


def test_pricing_validation() -> None:
    with pytest.raises(ValueError):
        Pricing(device_hour_usd=0.0, num_devices=1, device_kind="gpu", api_output_usd_per_m=1.0)
    with pytest.raises(ValueError):
        Pricing(device_hour_usd=1.0, num_devices=0, device_kind="gpu", api_output_usd_per_m=1.0)
    with pytest.raises(ValueError):
        Pricing(device_hour_usd=1.0, num_devices=1, device_kind="gpu", api_output_usd_per_m=0.0)
