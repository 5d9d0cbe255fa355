"""The converter with FP4 recipes and layer policies: the report names the product path each
FP4 GEMM takes (reference, sm100 F.scaled_mm, or none), a policy is one plan checked before
the model changes, expert weights stay in high precision under FP4. CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import f8tensor.convert
from f8tensor import (
    FP4_CAST_DTYPE,
    CastConfig,
    Float8ExpertWeight,
    Float8Linear,
    Float8LinearConfig,
    MX_1x32,
    NVFP4_1x16,
    block_policy,
    convert_to_float8_training,
    convert_with_policy,
)
from f8tensor.gemm.blocks import fp4_path

REFERENCE = "reference (emulated: dequantized per block, fp32 matmul; no FP4 kernel on cpu)"


def _fake_gpu(monkeypatch, sm: tuple[int, int], cuda: str = "12.8") -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: sm)
    monkeypatch.setattr(torch.version, "cuda", cuda)


def test_fp4_path_per_device_and_kinds(monkeypatch):
    assert fp4_path("nvfp4", "nvfp4", "cpu", False) == REFERENCE
    _fake_gpu(monkeypatch, (10, 0))
    assert fp4_path("nvfp4", "nvfp4", "cuda", False) == "sm100 F.scaled_mm, NVFP4 1x16 x 1x16 (unverified)"
    assert fp4_path("mxfp4", "mxfp4", "cuda", False) == "sm100 F.scaled_mm, MXFP4 1x32 x 1x32 (unverified)"
    assert fp4_path("nvfp4", "nvfp4", "cuda", True).startswith("reference (emulated") and "emulate=True" in fp4_path(
        "nvfp4", "nvfp4", "cuda", True
    )
    assert fp4_path("nvfp4", None, "cuda", False).startswith("none: no kernel multiplies nvfp4 x FP8/plain")
    assert fp4_path("nvfp4", "mxfp4", "cuda", False).startswith("none: no kernel multiplies nvfp4 x mxfp4")
    _fake_gpu(monkeypatch, (9, 0))  # Hopper: no FP4 tensor cores
    assert fp4_path("nvfp4", "nvfp4", "cuda", False).startswith("none: the NVFP4 1x16 x 1x16 kernel needs")
    _fake_gpu(monkeypatch, (10, 0), cuda="12.6")
    assert fp4_path("mxfp4", "mxfp4", "cuda", False).startswith("none: the MXFP4 1x32 x 1x32 kernel needs")


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_report_names_the_fp4_path_of_each_gemm(recipe, caplog):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 40))
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))
    line = next(r.getMessage() for r in caplog.records if "converted" in r.getMessage())
    assert f"FP4 forward/grad_input/grad_weight {REFERENCE}: 2 layers [0, 2]" in line
    assert "1 dims not multiples of 32 (whole FP4 blocks) [3]" in line


def test_report_lists_only_the_fp4_gemms_of_per_gemm_formats(caplog):
    nv, mx8 = CastConfig(FP4_CAST_DTYPE, NVFP4_1x16), CastConfig(torch.float8_e4m3fn, MX_1x32)
    cfg = Float8LinearConfig(
        input=mx8,
        weight=mx8,
        grad_output=nv,
        gemm_overrides={("grad_input", "weight"): nv, ("grad_weight", "grad_output"): None},
    )
    model = nn.Sequential(nn.Linear(64, 64))
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(model, config=cfg)
    line = caplog.records[-1].getMessage()
    assert f"FP4 grad_input {REFERENCE}: 1 layers [0]" in line
    assert "FP4 forward" not in line and "FP4 grad_weight" not in line  # MXFP8, high precision


def test_report_warns_when_no_fp4_kernel_runs(monkeypatch, caplog):
    # The layers are on CPU; the report is asked as if they sat on a Hopper GPU with emulate off.
    _fake_gpu(monkeypatch, (9, 0))
    real = fp4_path
    monkeypatch.setattr(f8tensor.convert, "fp4_path", lambda a, b, device, emulate: real(a, b, "cuda", emulate))
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.warns(UserWarning, match="FP4 forward/grad_input/grad_weight none: the NVFP4 1x16 x 1x16 kernel needs"):
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("nvfp4"))
    model = nn.Sequential(nn.Linear(64, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level("INFO", logger="f8tensor"):
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("nvfp4", emulate=True))
    assert (
        "FP4 forward/grad_input/grad_weight reference (emulated: dequantized per block, fp32 matmul; emulate=True)"
        in caplog.text
    )


class _Blocks(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(n))
        self.head = nn.Linear(64, 32)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_policy_is_one_plan_reported_and_refuses_another_recipe(caplog):
    model = _Blocks()
    nv, fp8 = Float8LinearConfig.from_recipe("nvfp4"), Float8LinearConfig.from_recipe("mxfp8")
    policy = block_policy(model, nv, hp_last_blocks=1, edge_config=fp8)
    with caplog.at_level("INFO", logger="f8tensor"):
        out = convert_with_policy(model, policy)
    line = caplog.records[-1].getMessage()
    assert "converted 5 of 6 linear layers" in line
    assert "1 kept in high precision by the layer policy [layers.3.0]" in line
    assert f"FP4 forward/grad_input/grad_weight {REFERENCE}: 3 layers [layers.0.0, layers.1.0, layers.2.0]" in line
    assert out.float8_converted_fqns == ("embed", "head", "layers.0.0", "layers.1.0", "layers.2.0")
    # Again with the same policy: counted, nothing changes; another policy: refused by name.
    before = [id(m) for m in model.modules()]
    assert convert_with_policy(model, policy).float8_converted_fqns == out.float8_converted_fqns
    assert [id(m) for m in model.modules()] == before
    with pytest.raises(ValueError, match=r"already FP8 with another recipe \[embed, head\]"):
        convert_with_policy(model, block_policy(model, nv, hp_last_blocks=1))
    assert [id(m) for m in model.modules()] == before


def test_policy_raising_midway_leaves_the_model_unchanged():
    model = _Blocks()
    nv = Float8LinearConfig.from_recipe("nvfp4")

    def policy(mod, fqn):
        if fqn == "head":
            raise RuntimeError("policy failed")
        return nv

    with pytest.raises(RuntimeError, match="policy failed"):
        convert_with_policy(model, policy)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    with pytest.raises(TypeError, match="Float8LinearConfig"):
        convert_with_policy(model, lambda mod, fqn: "nvfp4")
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    with pytest.raises(TypeError, match="policy must be a callable"):
        convert_with_policy(model, "nvfp4")


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = 2
        self.gate_up_proj = nn.Parameter(torch.randn(2, 64, 64))


def test_expert_weights_run_fp4_under_fp4_by_the_per_expert_loop(caplog):
    # Before: experts stayed bf16 under FP4 and per-GEMM formats ("run on linear layers only").
    model = nn.ModuleDict({"experts": _Experts(), "proj": nn.Linear(64, 64)})
    nv = Float8LinearConfig.from_recipe("nvfp4", emulate=True)
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(model, config=nv)
    assert "per-expert loop of Float8Linear's per-GEMM-format GEMMs" in caplog.text
    w = model["experts"].gate_up_proj
    assert isinstance(w, Float8ExpertWeight) and w._config == nv
    x = torch.randn(12, 64)
    offs = torch.tensor([5, 12], dtype=torch.int32)
    y = torch._grouped_mm(x, w, offs=offs)
    for g, rows in enumerate((slice(0, 5), slice(5, 12))):
        layer = Float8Linear.from_float(nn.Linear(64, 64, bias=False), nv)
        layer.weight.data = w._hp[g].t().contiguous()
        assert torch.equal(y[rows], layer(x[rows]))
    narrow = _Experts()
    narrow.gate_up_proj = nn.Parameter(torch.randn(2, 64, 48))
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(nn.ModuleDict({"experts": narrow, "proj": nn.Linear(64, 64)}), config=nv)
    assert "expert weights with dims not multiples of 32" in caplog.text
    assert type(narrow.gate_up_proj) is nn.Parameter
    model = nn.ModuleDict({"experts": _Experts(), "proj": nn.Linear(64, 64)})
    nv = Float8LinearConfig.from_recipe("nvfp4")
    convert_with_policy(model, lambda mod, fqn: nv, experts_config=Float8LinearConfig.from_recipe("rowwise"))
    assert model.float8_converted_fqns == ("proj", "experts.gate_up_proj")
