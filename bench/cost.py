"""What the measured throughput costs, and when self-hosting beats an API.

* **Dollars per million tokens**: the deployment's hourly price (``device_hour_usd`` ×
  ``num_devices``) divided by the millions of tokens it produces in an hour at the measured
  rate. The output figure charges the whole price to output tokens and the input figure the
  whole price to input tokens (the way per-token serving costs are usually quoted), so the two
  are alternatives, not parts of one bill.
* **Break-even volume**: self-hosting costs a flat ``monthly_cost_usd`` (the devices rented
  for a month, :data:`HOURS_PER_MONTH` hours); the API costs ``price`` per million tokens.
  Volumes are counted in output tokens; each output token brings ``input_per_output`` input
  tokens (the workload's measured ratio), billed at the API's input price. The API's cost per
  output token is therefore ``(api_output + input_per_output × api_input) / 1e6`` and the
  break-even monthly volume is ``monthly_cost_usd`` divided by it. Above it the fixed price is
  cheaper, up to the deployment's monthly capacity (measured tokens/s × seconds per month).
  When the break-even volume exceeds that capacity, this deployment never beats the API: more
  replicas add capacity and cost in the same proportion.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

HOURS_PER_MONTH = 730.0  # 365 × 24 / 12
SECONDS_PER_HOUR = 3600.0
DEFAULT_CPU_CORE_HOUR_USD = 0.045  # about what a cloud vCPU-hour costs on demand; pass your own
DEFAULT_API_USD_PER_M = 0.50  # an example API price per million output tokens; pass your own


@dataclass(frozen=True)
class Pricing:
    """Price assumptions; every figure derived from them is only as good as they are."""

    device_hour_usd: float  # per device (one GPU, or one CPU core) per hour
    num_devices: int
    device_kind: str  # "gpu" or "cpu-core"
    api_output_usd_per_m: float  # the API's price per million output tokens
    api_input_usd_per_m: float = 0.0  # ... and per million input tokens

    def __post_init__(self) -> None:
        if not self.device_hour_usd > 0:
            raise ValueError(f"device hour price must be > 0, got {self.device_hour_usd}")
        if self.num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}")
        if not self.api_output_usd_per_m > 0 or self.api_input_usd_per_m < 0:
            raise ValueError("the API output price must be > 0 and the input price >= 0, got "
                             f"{self.api_output_usd_per_m}, {self.api_input_usd_per_m}")

    @property
    def hourly_usd(self) -> float:
        return self.device_hour_usd * self.num_devices

    @property
    def monthly_usd(self) -> float:
        return self.hourly_usd * HOURS_PER_MONTH


def usd_per_million_tokens(hourly_usd: float, tokens_per_s: float) -> float:
    """The hourly price over the millions of tokens produced in an hour."""
    if not tokens_per_s > 0:
        raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s}")
    return hourly_usd / (tokens_per_s * SECONDS_PER_HOUR / 1e6)


def break_even_tokens_per_month(monthly_usd: float, api_output_usd_per_m: float,
                                api_input_usd_per_m: float = 0.0,
                                input_per_output: float = 0.0) -> float:
    """Monthly output-token volume at which the flat monthly price equals the API bill."""
    api_usd_per_output_token = (api_output_usd_per_m + input_per_output * api_input_usd_per_m) / 1e6
    if not api_usd_per_output_token > 0:
        raise ValueError("the API price per output token must be > 0")
    return monthly_usd / api_usd_per_output_token


def monthly_capacity_tokens(tokens_per_s: float) -> float:
    return tokens_per_s * SECONDS_PER_HOUR * HOURS_PER_MONTH


@dataclass(frozen=True)
class CostFigures:
    usd_per_m_output_tokens: float
    usd_per_m_input_tokens: float
    monthly_cost_usd: float
    monthly_capacity_output_tokens: float
    break_even_output_tokens_per_month: float

    @property
    def self_hosting_can_win(self) -> bool:
        """Whether the break-even volume is within what the deployment can produce."""
        return self.break_even_output_tokens_per_month <= self.monthly_capacity_output_tokens

    def to_dict(self) -> dict:
        return asdict(self)


def cost_figures(pricing: Pricing, output_tokens_per_s: float, input_tokens_per_s: float) -> CostFigures:
    monthly = pricing.monthly_usd
    return CostFigures(
        usd_per_m_output_tokens=usd_per_million_tokens(pricing.hourly_usd, output_tokens_per_s),
        usd_per_m_input_tokens=usd_per_million_tokens(pricing.hourly_usd, input_tokens_per_s),
        monthly_cost_usd=monthly,
        monthly_capacity_output_tokens=monthly_capacity_tokens(output_tokens_per_s),
        break_even_output_tokens_per_month=break_even_tokens_per_month(
            monthly, pricing.api_output_usd_per_m, pricing.api_input_usd_per_m,
            input_tokens_per_s / output_tokens_per_s),
    )


@dataclass(frozen=True)
class CostVersus:
    """Two systems measured on the same machine at the same price: dollars per million output
    tokens of each, and ours over theirs (below 1: ours is cheaper). At one hourly price the
    ratio is their throughput over ours."""

    ours_usd_per_m_output: float
    peer_usd_per_m_output: float

    @property
    def ratio(self) -> float:
        return self.ours_usd_per_m_output / self.peer_usd_per_m_output

    def to_dict(self) -> dict:
        return asdict(self) | {"ratio": self.ratio}


def cost_versus(pricing: Pricing, ours_tokens_per_s: float, peer_tokens_per_s: float) -> CostVersus:
    return CostVersus(usd_per_million_tokens(pricing.hourly_usd, ours_tokens_per_s),
                      usd_per_million_tokens(pricing.hourly_usd, peer_tokens_per_s))
