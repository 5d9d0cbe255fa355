"""The demo's ``--optim`` flag and its optimizer-state column."""

from __future__ import annotations

import pytest
import torch
from helpers import demo_table

from f8tensor import demo
from f8tensor.optim import FP8_BLOCK, AdamW


def test_optim_flag_builds_the_optimizer_it_names():
    params = [torch.nn.Parameter(torch.zeros(4, FP8_BLOCK))]
    assert type(demo.make_optimizer("adamw", params, 1e-3)) is torch.optim.AdamW
    for name, dtype in (("adamw-bf16", torch.bfloat16), ("adamw-fp8", torch.float8_e4m3fn)):
        opt = demo.make_optimizer(name, params, 1e-3)
        assert isinstance(opt, AdamW) and opt.param_groups[0]["state_dtype"] == dtype
        assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["weight_decay"] == 0.1


def test_unknown_optim_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--optim", "sgd"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--optim" in err and "adamw-fp8" in err


def test_optimizer_state_bytes_count_moments_and_scales_not_steps():
    p = torch.nn.Parameter(torch.zeros(4, FP8_BLOCK))
    bias = torch.nn.Parameter(torch.zeros(4))
    sizes = {}
    for name in ("adamw", "adamw-bf16", "adamw-fp8"):
        opt = demo.make_optimizer(name, [p, bias], 1e-3)
        p.grad, bias.grad = torch.ones_like(p), torch.ones_like(bias)
        opt.step()
        sizes[name] = demo.optimizer_state_bytes(opt)
    # fp32: 2 x 4 bytes per element; bf16: 2 x 2; FP8: 2 x 1 plus one fp32 scale per row of
    # 128 per moment. The 4-element bias keeps fp32 moments under FP8 (1-D), bf16 under bf16.
    assert sizes == {"adamw": 8 * 516, "adamw-bf16": 4 * 516, "adamw-fp8": 2 * 512 + 2 * 4 * 4 + 8 * 4}


def test_tiny_run_with_fp8_states_prints_the_optimizer_column(capsys, tmp_path):
    argv = ["--size", "tiny", "--steps", "4", "--recipes", "bf16", "--out", str(tmp_path / "c.png")]
    assert demo.main([*argv, "--optim", "adamw-fp8"]) == 0
    out = capsys.readouterr().out
    assert "optim   adamw-fp8: f8tensor.optim.AdamW, FP8 (e4m3) moments" in out
    fp8_mib = float(demo_table(out)["bf16"]["opt. MiB"])  # one row: every column shown
    model = demo.GPT(demo.SIZES["tiny"])
    # Every 2-D weight's moments in FP8 (1 + 1 bytes, plus 8 bytes of scales per 128-wide
    # row block), the 1-D biases and norms in fp32: about a quarter of fp32 AdamW's 8 bytes.
    expected = sum(
        (2 * p.numel() + 8 * p.shape[0] * -(-p[0].numel() // FP8_BLOCK)) if p.dim() >= 2 else 8 * p.numel()
        for p in model.parameters()
    )
    assert fp8_mib == pytest.approx(expected / 2**20, abs=0.006)
    fp32_mib = 8 * sum(p.numel() for p in model.parameters()) / 2**20
    assert fp8_mib < 0.3 * fp32_mib, (fp8_mib, fp32_mib)
