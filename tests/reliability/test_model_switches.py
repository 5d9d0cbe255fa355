"""Surface reliability: all-or-nothing model switches, honest dtype conversions, and errors
that name the argument or field at fault and what it allows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import f8tensor
from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training
from f8tensor.convert import block_policy, keep_last_blocks_in_hp
from f8tensor.distributed.fsdp import Float8AllGatherWeight

K = 32


def _mixed_model() -> nn.Module:
    """A dynamic-scaling layer, then a delayed-scaling one (which refuses per-GEMM formats)."""
    model = nn.Sequential(nn.Linear(K, K), nn.Linear(K, K))
    model[0] = Float8Linear.from_float(model[0], Float8LinearConfig.from_recipe("tensorwise"))
    model[1] = Float8Linear.from_float(model[1], Float8LinearConfig.from_recipe("delayed"))
    return model


def test_set_forward_in_high_precision_is_all_or_nothing():
    model = _mixed_model()
    before = [m.config for m in model]
    with pytest.raises(ValueError, match=r"layer '1'.*nothing was changed"):
        f8tensor.set_forward_in_high_precision(model)
    # Before the fix layer 0 was already switched when layer 1 refused.
    assert [m.config for m in model] == before


def _all_gather_model() -> nn.Module:
    config = Float8LinearConfig.from_recipe("tensorwise", enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(nn.Sequential(nn.Linear(K, K)), config=config)


@pytest.mark.parametrize("convert", [lambda m: m.double(), lambda m: m.to(torch.float64)], ids=["double", "to_float64"])
def test_fp8_all_gather_weight_refuses_float64(convert):
    model = _all_gather_model()
    # Before the fix the weight claimed float64 and held float32.
    with pytest.raises(TypeError, match=r"FP8 all-gather weight.*cannot convert it to torch.float64"):
        convert(model)
    weight = model[0].weight
    assert type(weight) is Float8AllGatherWeight and weight.dtype == weight._hp.dtype == torch.float32


@pytest.mark.parametrize(
    ("convert", "dtype"),
    [
        (lambda m: m.half(), torch.float16),
        (lambda m: m.bfloat16(), torch.bfloat16),
        (lambda m: m.to(torch.bfloat16), torch.bfloat16),
        (lambda m: m.float(), torch.float32),
    ],
    ids=["half", "bfloat16", "to_bfloat16", "float"],
)
def test_fp8_all_gather_weight_converts_truly_to_hp_dtypes(convert, dtype):
    model = convert(_all_gather_model())
    weight = model[0].weight
    assert type(weight) is Float8AllGatherWeight and weight.dtype == weight._hp.dtype == dtype


@pytest.mark.parametrize(
    "overrides",
    [5, None, "forward", [("forward", "input")], [None], "grad_weight.input", (("forward",),), {"forward": None}],
    ids=["int", "None", "str", "pair", "None_entry", "dotted_str", "one_tuple", "str_key"],
)
def test_malformed_gemm_overrides_name_the_field(overrides):
    # Before the fix: IndexError, or Python's own TypeError ("'int' object is not iterable").
    with pytest.raises((TypeError, ValueError), match=r"gemm_overrides.*\(gemm, operand"):
        Float8LinearConfig.from_recipe("rowwise", gemm_overrides=overrides)


@pytest.mark.parametrize("overrides", [5, "forward", [("forward", "input")]], ids=["int", "str", "pair"])
def test_malformed_with_gemm_formats_names_the_field(overrides):
    with pytest.raises((TypeError, ValueError), match=r"gemm_overrides.*\(gemm, operand"):
        Float8LinearConfig.from_recipe("rowwise").with_gemm_formats(overrides)


def _blocks_model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(K, K) for _ in range(3)])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"hp_last_blocks": -1}, ValueError, r"hp_last_blocks must be an int >= 0"),
        ({"hp_last_blocks": 1.5}, ValueError, r"hp_last_blocks must be an int >= 0"),
        ({"hp_last_blocks": True}, ValueError, r"hp_last_blocks must be an int >= 0"),
        ({"block_pattern": 3}, TypeError, r"block_pattern must be a regular expression"),
        ({"block_pattern": "layers.("}, ValueError, r"block_pattern is not a valid regular expression"),
        ({"block_pattern": r"layers\.\d+"}, ValueError, r"block_pattern must have a group"),
        ({"edge_config": "rowwise"}, TypeError, r"edge_config must be a Float8LinearConfig or None"),
        ({"config": None}, TypeError, r"config must be a Float8LinearConfig"),
    ],
    ids=[
        "negative",
        "float",
        "bool",
        "pattern_int",
        "pattern_bad_regex",
        "pattern_no_group",
        "edge_str",
        "config_none",
    ],
)
def test_block_policy_errors_name_the_argument(kwargs, error, message):
    args = {"config": Float8LinearConfig.from_recipe("rowwise"), **kwargs}
    config = args.pop("config")
    # Before the fix: "n must be an int >= 0", a bare re.error, or no error at all.
    with pytest.raises(error, match=rf"block_policy: {message}"):
        block_policy(_blocks_model(), config, **args)


def test_block_pattern_without_group_fails_before_conversion():
    with pytest.raises(ValueError, match=r"keep_last_blocks_in_hp: block_pattern must have a group"):
        keep_last_blocks_in_hp(_blocks_model(), 1, block_pattern=r"\d")
    with pytest.raises(TypeError, match=r"keep_last_blocks_in_hp: model must be an nn.Module"):
        keep_last_blocks_in_hp("model", 1)


# ------------------------------------------------------------------ torch.compile(dynamic=True)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_two_layer_mlp_compiles_with_dynamic_shapes(recipe):
    # Before the fix dynamo failed on the first call ("lift_tracked_freevar_to_input should not
    # be called on root SubgraphTracer"): a float constant read inside the first layer's
    # autograd Function became a symbol bound in that subgraph, reused by the second layer's.
    torch._dynamo.reset()

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(K, 64), nn.GELU(), nn.Linear(64, K))
        return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))

    eager, compiled_model = mlp(), mlp()
    compiled = torch.compile(compiled_model, backend="aot_eager", dynamic=True)
    for tokens in (16, 32, 48):
        x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(tokens))
        xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ye, yc = eager(xe), compiled(xc)
        g = torch.randn(ye.shape, generator=torch.Generator().manual_seed(1))
        ye.backward(g)
        yc.backward(g)
        # Measured: bitwise equal (the same casts and products, traced).
        assert torch.equal(ye, yc), f"{recipe} tokens={tokens}: output"
        assert torch.equal(xe.grad, xc.grad), f"{recipe} tokens={tokens}: grad_x"
        for (name, pe), pc in zip(eager.named_parameters(), compiled_model.parameters()):
            assert torch.equal(pe.grad, pc.grad), f"{recipe} tokens={tokens}: {name}.grad"


def test_eps_literals_equal_eps():
    import inspect

    from f8tensor.quant import scaling

    assert scaling.EPS == 2.0**-100
    assert inspect.getsource(scaling).count("clamp(min=2.0**-100)") == 3


class _Experts(nn.Module):
    def __init__(self, n: int = 2, k: int = 64, out: int = 64):
        super().__init__()
        self.num_experts = n
        self.gate_up_proj = nn.Parameter(torch.randn(n, k, out))


def _attention_experts_linear(recipe: str | Float8LinearConfig = "rowwise") -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"attn": nn.MultiheadAttention(64, 4, batch_first=True), "experts": _Experts(), "proj": nn.Linear(64, 64)}
    )
    config = recipe if isinstance(recipe, Float8LinearConfig) else Float8LinearConfig.from_recipe(recipe)
    return convert_to_float8_training(model, config=config)


def _attend(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model["attn"](x, x, x, need_weights=False)[0]


def test_set_forward_in_high_precision_reaches_attention_and_expert_weights():
    # Before: only Float8Linear layers changed; attention projections and experts kept FP8 forwards.
    model = _attention_experts_linear()
    x = torch.randn(2, 8, 64)
    tokens, offs = torch.randn(12, 64), torch.tensor([5, 12], dtype=torch.int32)
    assert f8tensor.set_forward_in_high_precision(model) == 3  # the layer, the attention, the expert weight
    hp = Float8LinearConfig.from_recipe("rowwise").with_gemm_formats(
        {("forward", "input"): None, ("forward", "weight"): None}
    )
    reference = _attention_experts_linear(hp)  # the same seed: the same weights
    assert torch.equal(_attend(model, x), _attend(reference, x))
    w, w_ref = model["experts"].gate_up_proj, reference["experts"].gate_up_proj
    assert w._config == hp
    assert torch.equal(torch._grouped_mm(tokens, w, offs=offs), torch._grouped_mm(tokens, w_ref, offs=offs))
    plain = torch.cat([tokens[:5] @ w._hp[0], tokens[5:] @ w._hp[1]])
    assert torch.equal(torch._grouped_mm(tokens, w, offs=offs), plain)  # the forward runs in high precision


def test_set_gemm_formats_refuses_an_expert_weight_before_anything_changes():
    from f8tensor import FP4_CAST_DTYPE, CastConfig, NVFP4_1x16

    model = _attention_experts_linear()
    model["narrow"] = _Experts(out=48)
    f8tensor.convert_experts_to_float8(model["narrow"], Float8LinearConfig.from_recipe("rowwise"))
    before = (model["proj"].config, model["attn"].in_proj_weight._config, model["experts"].gate_up_proj._config)
    nvfp4 = CastConfig(FP4_CAST_DTYPE, NVFP4_1x16)
    with pytest.raises(
        ValueError,
        match=r"expert weight 'narrow.gate_up_proj' refuses .*\(nothing was changed\): FP4 expert GEMMs need the last two dims of \(2, 64, 48\) to be multiples of 32",
    ):
        f8tensor.set_gemm_formats(model, {("grad_weight", "input"): nvfp4, ("grad_weight", "grad_output"): nvfp4})
    after = (model["proj"].config, model["attn"].in_proj_weight._config, model["experts"].gate_up_proj._config)
    assert after == before and model["narrow"].gate_up_proj._config == before[2]


class _AttentionExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.experts = _Experts()

    def forward(self, x, offs):
        a = self.attn(x, x, x, need_weights=False)[0].reshape(-1, 64)
        return torch._grouped_mm(a, self.experts.gate_up_proj, offs=offs)


def test_a_compiled_model_follows_the_switch():
    torch.manual_seed(0)
    model = convert_to_float8_training(_AttentionExperts(), config=Float8LinearConfig.from_recipe("rowwise"))
    compiled = torch.compile(model, backend="aot_eager")
    x, offs = torch.randn(2, 8, 64), torch.tensor([7, 16], dtype=torch.int32)
    with torch.no_grad():
        before = compiled(x, offs)
        f8tensor.set_forward_in_high_precision(model)
        after, eager = compiled(x, offs), model(x, offs)
    assert torch.equal(after, eager) and not torch.equal(after, before)
