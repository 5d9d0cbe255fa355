"""Block quantizers (f8tensor/quant/block_quantizers.py): each storage role's cast against a
reference written from its definition, bit for bit, and its way back.

The roles: optimizer moments (e4m3, 128 elements of each dim-0 row per scale, stochastic
rounding with the caller's draws, back in fp32), saved activations (blocks along the last
dim), the FSDP2 and TP gathers (a shard cast as the rows of one process's cast of the whole
tensor) and export (the bytes ``Float8Tensor.from_hp`` gives). Inputs are structured: one
large value per block, so a block laid along the wrong dim (or over the flattened tensor
instead of each row) changes the scales and fails the bitwise checks.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_sqnr, bits, float_bits, scale_bits

from f8tensor import BLOCK_128x128, Float8LinearConfig, Float8Tensor, Granularity, MX_1x32
from f8tensor.quant.block_quantizers import (
    BlockQuantizer,
    activation_quantizer,
    export_quantizer,
    input_gather_quantizer,
    moment_quantizer,
    weight_gather_quantizer,
)
from f8tensor.quant.scaling import block_amax, tensor_amax
from f8tensor.quant.specs import CastSpec

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _structured(shape: tuple[int, ...], block: int, seed: int = 0) -> torch.Tensor:
    """Gaussian values with one value 50x larger in every run of ``block`` elements of each
    dim-0 row (the row seen flat), at a position that moves from block to block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.reshape(shape[0], -1)
    for start in range(0, flat.shape[1], block):
        flat[:, start + (start // block * 7) % min(block, flat.shape[1] - start)] *= 50.0
    return x


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3fn value, ascending, in float64."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).to(torch.float64)
    return torch.unique(values[torch.isfinite(values)])


def _row_block_scales(rows: torch.Tensor, block: int) -> torch.Tensor:
    """448 / max|x| of each run of ``block`` elements of each row, fp32 (the division in
    float64, then rounded once to fp32)."""
    out = torch.empty(rows.shape[0], -(-rows.shape[1] // block), dtype=torch.float32)
    for r in range(rows.shape[0]):
        for b in range(out.shape[1]):
            amax = rows[r, b * block : (b + 1) * block].abs().max().item()
            out[r, b] = torch.tensor(E4M3_MAX / amax, dtype=torch.float64).to(torch.float32)
    return out


def _stochastic_reference(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each fp32 ``x`` (within +-448) rounded to the e4m3 grid: down to the largest grid value
    at or below it, up to the next one when ``uniform < (x - down) / (up - down)``."""
    grid = _e4m3_grid()
    x64 = x.to(torch.float64).flatten()
    i = torch.searchsorted(grid, x64, right=True) - 1
    down = grid[i]
    up = grid[(i + 1).clamp(max=grid.numel() - 1)]
    frac = torch.where(up > down, (x64 - down) / (up - down), torch.zeros_like(x64))
    out = torch.where(uniform.to(torch.float64).flatten() < frac, up, down)
    return out.reshape(x.shape).to(E4M3)


def _moment_reference(value: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 moment of ``value`` from its definition: per 128-element block of each dim-0
    row, scale = 448 / amax, data = stochastic_round(value * scale)."""
    rows = value.reshape(value.shape[0], -1)
    scale = _row_block_scales(rows, 128)
    scaled = rows * scale.repeat_interleave(128, dim=1)[:, : rows.shape[1]]
    data = _stochastic_reference(scaled.clamp(-E4M3_MAX, E4M3_MAX), uniform.reshape(rows.shape))
    return data.reshape(value.shape), scale


@pytest.mark.parametrize("shape", [(6, 300), (4, 5, 70), (3, 128), (2, 2, 2, 64)], ids=str)
def test_moment_quantizer_is_the_definition_bit_for_bit(shape):
    q = moment_quantizer()
    value = _structured(shape, 128) * 1e-3
    rows = (shape[0], value.numel() // shape[0])
    uniform = torch.rand(rows, generator=torch.Generator().manual_seed(1))
    data, scale = q.quantize(value, uniform=uniform)
    want_data, want_scale = _moment_reference(value, uniform)
    assert data.dtype == E4M3 and data.shape == value.shape
    assert scale.shape == (rows[0], -(-rows[1] // 128))
    assert torch.equal(float_bits(scale), float_bits(want_scale))
    assert torch.equal(bits(data), bits(want_data))
    # The draws may also come in the tensor's own shape.
    again, _ = q.quantize(value, uniform=uniform.reshape(shape))
    assert torch.equal(bits(again), bits(data))


def test_moment_quantizer_way_back_is_fp32_data_over_scale():
    q = moment_quantizer()
    value = _structured((4, 5, 70), 128) * 1e-3
    data, scale = q.quantize(value, uniform=torch.rand(4, 350))
    back = q.dequantize(data, scale)
    want = (data.reshape(4, 350).to(torch.float32) / scale.repeat_interleave(128, dim=1)[:, :350]).reshape(4, 5, 70)
    assert back.dtype == torch.float32 and back.shape == value.shape
    assert torch.equal(float_bits(back), float_bits(want))
    gaussian = torch.randn(4, 5, 70) * 1e-3
    back = q.dequantize(*q.quantize(gaussian, uniform=torch.rand(4, 350)))
    # Gaussian moments, e4m3 with stochastic rounding, one scale per 128: measured 28.7 dB.
    assert_sqnr(gaussian, back, 27.0)


def test_moment_quantizer_stochastic_rounding_is_unbiased():
    """The mean of many stochastic casts of one value is that value (round to nearest is
    biased by up to half a spacing; e4m3's spacing at 0.3 is 1/32 of the scaled value)."""
    q = moment_quantizer()
    value = torch.full((1, 128), 0.3)
    value[0, 0] = 1.0  # the block's amax: scale 448
    draws = torch.rand(4096, 128, generator=torch.Generator().manual_seed(2))
    backs = [q.dequantize(*q.quantize(value, uniform=u.reshape(1, 128)))[0, 1:] for u in draws[:512]]
    mean = torch.stack(backs).mean().item()
    nearest = q._replace(spec=q.spec._replace(rounding="nearest"))
    biased = nearest.dequantize(*nearest.quantize(value))[0, 1].item()
    # 0.3 * 448 = 134.4 lies between e4m3 values 128 and 144: nearest gives 128 / 448 = 0.2857.
    assert abs(biased - 0.3) > 0.01
    # 512 x 127 draws: the mean's standard error is about 1.5e-4; measured 0.29998.
    assert abs(mean - 0.3) < 1e-3, mean


def test_moment_quantizer_takes_an_empty_shard():
    q = moment_quantizer()
    data, scale = q.quantize(torch.zeros(0, 5, 70), uniform=torch.zeros(0, 350))
    assert data.shape == (0, 5, 70) and scale.shape == (0, 3)
    assert q.dequantize(data, scale).shape == (0, 5, 70)


def test_moment_quantizer_refuses_a_vector():
    with pytest.raises(ValueError, match=r"dim-0 rows of a tensor with 2 dims or more; got shape \(300,\)"):
        moment_quantizer().quantize(torch.randn(300))


@pytest.mark.parametrize("block", [128, 32, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_quantizer_blocks_run_along_the_last_dim(block, dtype):
    x = torch.randn(3, 8, 300)
    x[..., ::block] *= 40.0  # one large value per block of the last dim
    x = x.to(dtype)
    q = activation_quantizer(E4M3, block, x.dim(), dtype)
    data, scale = q.quantize(x)
    rows = x.float().reshape(-1, 300)
    want_scale = _row_block_scales(rows, block).reshape(3, 8, -1)
    expanded = want_scale.repeat_interleave(block, dim=-1)[..., :300]
    want = (x.float() * expanded).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)  # round to nearest even
    assert torch.equal(float_bits(scale), float_bits(want_scale))
    assert torch.equal(bits(data), bits(want))
    back = q.dequantize(data, scale)
    assert back.dtype == dtype
    assert torch.equal(back, (data.float() / expanded).to(dtype))
    # The values beside the large ones (which the scale encodes exactly), e4m3 round to
    # nearest: measured 31.6-31.8 dB.
    rest = torch.ones(300, dtype=torch.bool)
    rest[::block] = False
    assert_sqnr(x.float()[..., rest], back.float()[..., rest], 30.0)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp8"])
def test_weight_gather_quantizer_casts_a_shard_as_rows_of_the_whole_weight(recipe):
    """What FSDP2's all-gather relies on: a dim-0 shard's bytes and scales are the rows of one
    process's cast of the whole weight; blocks a shard cuts (128x128 over 100-row shards)
    take the whole weight's scales, agreed from its block amaxes."""
    cast = Float8LinearConfig.from_recipe(recipe).weight
    q = weight_gather_quantizer(cast)
    full = _structured((300, 256), 32, seed=3)
    full_data, full_scale = q.quantize(full)
    block_rows = q.spec.block[0] or 1
    for start in (0, 100, 200):
        shard = full[start : start + 100]
        if 100 % block_rows == 0:
            data, scale = q.quantize(shard)
            assert torch.equal(
                scale_bits(scale), scale_bits(full_scale[start // block_rows : (start + 100) // block_rows])
            )
        else:
            agreed = q.scale_for(block_amax(full, q.spec.block))
            row_scale = agreed[torch.arange(start, start + 100) // block_rows]
            data, _ = q.with_block((1, *q.spec.block[1:])).quantize(shard, row_scale)
        assert torch.equal(bits(data), bits(full_data[start : start + 100]))


def test_weight_gather_quantizer_takes_the_agreed_tensorwise_scale():
    cast = Float8LinearConfig.from_recipe("tensorwise").weight
    q = weight_gather_quantizer(cast)
    full = _structured((300, 256), 32, seed=4)
    scale = q.scale_for(tensor_amax(full))
    want = Float8Tensor.from_hp(full)
    assert torch.equal(float_bits(scale), float_bits(want._scale))
    for start in (0, 150):
        data, used = q.quantize(full[start : start + 150], scale)
        assert used is scale
        assert torch.equal(bits(data), bits(want._data[start : start + 150]))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_input_gather_quantizer_casts_a_sequence_shard_as_one_process(recipe):
    """TP's sequence-parallel gather: each rank casts its tokens (dim 1) with the layer's input
    cast, tensorwise with the scale of the group's amax; the gathered bytes and scales are
    one process's cast of the full input."""
    cast = Float8LinearConfig.from_recipe(recipe).input
    x = _structured((2, 64, 256), 32, seed=5)
    q = input_gather_quantizer(cast, x.dim())
    full_data, full_scale = q.quantize(x)
    agreed = q.scale_for(tensor_amax(x)) if not q.spec.block else None
    shards = [q.quantize(x[:, s : s + 32], agreed) for s in (0, 32)]
    assert torch.equal(bits(torch.cat([d for d, _ in shards], 1)), bits(full_data))
    if agreed is None:
        assert torch.equal(scale_bits(torch.cat([s for _, s in shards], 1)), scale_bits(full_scale))
    else:
        assert torch.equal(float_bits(agreed), float_bits(full_scale))


@pytest.mark.parametrize("granularity", [Granularity.TENSORWISE, Granularity.ROWWISE, BLOCK_128x128, MX_1x32], ids=str)
def test_export_quantizer_gives_the_bytes_of_from_hp(granularity):
    w = _structured((256, 384), 32, seed=6).to(torch.bfloat16)
    data, scale = export_quantizer(granularity).quantize(w)
    want = Float8Tensor.from_hp(w, granularity=granularity)
    assert torch.equal(bits(data), bits(want._data))
    assert scale.dtype == want._scale.dtype and torch.equal(scale_bits(scale), scale_bits(want._scale))


def test_with_block_and_block_of():
    q = BlockQuantizer(CastSpec(E4M3, (128, 128)))
    assert q.with_block((1, 128)).spec == CastSpec(E4M3, (1, 128))
    assert q.block_of(2) == (128, 128)
    assert BlockQuantizer(CastSpec(E4M3)).block_of(3) == (0, 0, 0)
