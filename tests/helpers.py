"""Shared test helpers: SQNR, bf16 bit patterns, FP8 byte comparison."""
import torch


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `actual` against `reference`, in dB (float64)."""
    ref = reference.detach().double()
    noise = (actual.detach().double() - ref).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise)) if noise > 0 else float("inf")


def all_bf16_values(device="cpu") -> torch.Tensor:
    """Every one of the 65536 bfloat16 bit patterns (NaNs, infs, subnormals included)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device).to(torch.int16)
    return bits.view(torch.bfloat16)


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)
