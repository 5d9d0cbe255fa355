"""Round 5 campaign: the CPU product op ``f8tensor::cpu_scaled_mm`` and the retired checkpoint formats.

The op's reference is ``torch._scaled_mm``: what it refuses on CUDA is refused (its CPU kernel
where it refuses too), and what it accepts gives its shapes and, for the per-tensor and
per-row products, the values of the definition (fp32 product of the dequantized operands).
Checkpoints: the current format round-trips bit for bit; pre-release formats are refused
naming the git tag that still reads them.
"""

from __future__ import annotations

import copy
import io
import pathlib
import pickle

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from f8tensor import BLOCK_128x128, Float8Tensor, MX_1x32, compat
from f8tensor.tensor import _SERIAL_VERSION, _rebuild_float8_tensor
from f8tensor.tensor.validation import LEGACY_TAG, RETIRED_FORMAT

OP = torch.ops.f8tensor.cpu_scaled_mm.default
#: torch's own ``torch._scaled_mm`` (the tests' rules check wraps the public name).
TORCH_SCALED_MM = compat._SCALED_MM
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = torch.tensor(1.0)
FIXTURE_V0 = pathlib.Path(__file__).resolve().parents[1] / "data" / "float8_tensor_v0.pt"


def _f8(*shape: int, dtype: torch.dtype = E4, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(*shape).to(dtype)


def _definition(a, b, sa, sb) -> torch.Tensor:
    """The product from its definition, in float64: (a * sa) @ (b * sb)."""
    return (a.double() * sa.double()) @ (b.double() * sb.double())


# ----------------------------------------------------------------- refusals

# (id, mat1, mat2, scale_a, scale_b, match, torch's CPU kernel refuses too)
REFUSED = [
    ("mat1_3d", _f8(2, 16, 32), _f8(32, 16), ONE, ONE, "must be matrices", True),
    ("mat1_1d", _f8(32), _f8(32, 16), ONE, ONE, "must be matrices", True),
    ("mat2_3d", _f8(16, 32), _f8(1, 32, 16), ONE, ONE, "must be matrices", True),
    ("mat1_bf16", torch.randn(16, 32).bfloat16(), _f8(32, 16), ONE, ONE, "must be FP8", True),
    ("mat2_fp32", _f8(16, 32), torch.randn(32, 16), ONE, ONE, "must be FP8", True),
    ("mat1_int8", torch.zeros(16, 32, dtype=torch.int8), _f8(32, 16), ONE, ONE, "must be FP8", True),
    ("inner_mismatch", _f8(16, 32), _f8(16, 16), ONE, ONE, "cannot be multiplied", True),
    # torch's CPU kernel takes these; CUDA's refuses: "scale_a and scale_b must be float (fp32)".
    ("scale_bf16", _f8(16, 32), _f8(32, 16), ONE.bfloat16(), ONE, "must be float32", False),
    ("scale_fp64", _f8(16, 32), _f8(32, 16), ONE, ONE.double(), "must be float32", False),
    ("scale_int", _f8(16, 32), _f8(32, 16), torch.tensor(1), torch.tensor(1), "must be float32", False),
    ("scale_vectors", _f8(16, 32), _f8(32, 16), torch.ones(16), torch.ones(16), "Invalid scaling", True),
    ("rowwise_swapped", _f8(16, 32), _f8(32, 16), torch.ones(1, 16), torch.ones(16, 1), "Invalid scaling", True),
    ("rowwise_short", _f8(16, 32), _f8(32, 16), torch.ones(8, 1), torch.ones(1, 16), "Invalid scaling", True),
    ("two_element_scale", _f8(16, 32), _f8(32, 16), torch.ones(2), ONE, "Invalid scaling", True),
    ("tensor_and_row", _f8(16, 32), _f8(32, 16), ONE, torch.ones(1, 16), "Invalid scaling", True),
]


@pytest.mark.parametrize(
    ("a", "b", "sa", "sb", "match", "torch_refuses"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_refuses_what_scaled_mm_refuses(a, b, sa, sb, match, torch_refuses):
    with pytest.raises((RuntimeError, ValueError), match=match):
        OP(a, b, sa, sb)
    if torch_refuses:
        with pytest.raises((RuntimeError, ValueError)):
            TORCH_SCALED_MM(a, b, sa, sb, out_dtype=torch.float32)


def test_rules_check_passes_a_vector_operand_to_the_refusal(cuda_rules):
    # Found: the check's call summary read mat1.shape[1] and raised IndexError first.
    with pytest.raises(RuntimeError, match="must be matrices"):
        torch._scaled_mm(_f8(32), _f8(32, 16), ONE, ONE, out_dtype=torch.float32)
    assert cuda_rules.take()


@pytest.mark.parametrize(
    ("a", "b", "sa", "sb", "match"),
    [r[1:6] for r in REFUSED if r[0] in ("mat1_3d", "mat1_bf16", "scale_bf16", "rowwise_swapped")],
    ids=["mat1_3d", "mat1_bf16", "scale_bf16", "rowwise_swapped"],
)
def test_fake_kernel_refuses_as_the_real_one(a, b, sa, sb, match):
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (a, b, sa, sb)]
        with pytest.raises((RuntimeError, ValueError), match=match):
            OP(*fake)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"bias": torch.zeros(8)}, "Bias must be size 16"), ({"out_dtype": torch.int32}, "out_dtype must be one of")],
    ids=["bias_size", "out_dtype_int"],
)
def test_compat_scaled_mm_refuses_epilogue_arguments(kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        compat.scaled_mm(_f8(16, 32), _f8(32, 16), ONE, ONE, **kwargs)


def _out_case(out: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16):
    a, b = _f8(16, 32), _f8(32, 16, seed=1)
    return compat.scaled_mm(a, b, ONE, ONE, out_dtype=out_dtype, out=out), TORCH_SCALED_MM(
        a, b, ONE, ONE, out_dtype=out_dtype
    )


def test_out_argument_receives_the_product():
    out = torch.empty(16, 16, dtype=torch.bfloat16)
    got, want = _out_case(out)
    assert got is out and torch.equal(out, want)


def test_out_argument_of_another_shape_is_resized_as_torch_does():
    # Found: the copy into a (3, 3) out failed with a broadcasting error; torch resizes out=.
    out = torch.empty(3, 3, dtype=torch.bfloat16)
    got, want = _out_case(out)
    assert got.shape == (16, 16) and torch.equal(got, want)


def test_out_argument_of_another_dtype_is_refused_as_torch_does():
    # Found: an fp32 out= with out_dtype=bf16 silently returned fp32.
    out = torch.empty(16, 16)
    with pytest.raises(RuntimeError, match="out_dtype must match output matrix type"):
        compat.scaled_mm(_f8(16, 32), _f8(32, 16), ONE, ONE, out_dtype=torch.bfloat16, out=out)
    # torch's own CPU kernel raises RuntimeError on some CPUs, ValueError on others (another kernel path).
    with pytest.raises((RuntimeError, ValueError), match="out_dtype must match output matrix type"):
        TORCH_SCALED_MM(_f8(16, 32), _f8(32, 16), ONE, ONE, out_dtype=torch.bfloat16, out=out)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bias_in_the_epilogue_as_torch(bias_dtype):
    a, b, bias = _f8(16, 32), _f8(32, 16, seed=1), torch.linspace(-1, 1, 16).to(bias_dtype)
    got = compat.scaled_mm(a, b, ONE, ONE, bias=bias, out_dtype=torch.bfloat16)
    assert torch.equal(got, TORCH_SCALED_MM(a, b, ONE, ONE, bias=bias, out_dtype=torch.bfloat16))


def test_empty_inner_dimension_gives_the_bias():
    bias = torch.linspace(-1, 1, 16)
    got = compat.scaled_mm(_f8(4, 0), _f8(0, 16), ONE, ONE, bias=bias, out_dtype=torch.float32)
    assert torch.equal(got, bias.expand(4, 16))


def test_scale_requiring_grad_is_refused_as_aten_has_no_derivative():
    # Found: autograd recorded the op's fp32 body (a gradient torch._scaled_mm refuses to give).
    scale = torch.tensor(1.0, requires_grad=True)
    with pytest.raises(RuntimeError, match="has no derivative"):
        OP(_f8(16, 32), _f8(32, 16), scale, ONE)
    with pytest.raises(RuntimeError, match="derivative for aten::_scaled_mm is not implemented"):
        TORCH_SCALED_MM(_f8(16, 32), _f8(32, 16), scale, ONE, out_dtype=torch.float32).sum().backward()


def test_scale_requiring_grad_under_no_grad_runs():
    scale = torch.tensor(0.5, requires_grad=True)
    with torch.no_grad():
        out = OP(_f8(16, 32), _f8(32, 16), scale, ONE)
    assert not out.requires_grad
    assert torch.equal(out, OP(_f8(16, 32), _f8(32, 16), scale.detach(), ONE))


# ----------------------------------------------------------------- accepted

# (id, m, k, n, dtype of mat1, dtype of mat2, rowwise scales)
ACCEPTED = [
    ("tensorwise", 16, 32, 16, E4, E4, False),
    ("rowwise", 16, 32, 16, E4, E4, True),
    ("e5m2_e4m3", 16, 32, 16, E5, E4, False),
    ("e5m2_e5m2", 16, 32, 16, E5, E5, False),
    ("fnuz", 16, 32, 16, torch.float8_e4m3fnuz, torch.float8_e4m3fnuz, False),
    ("odd_sizes", 3, 5, 7, E4, E4, False),
    ("odd_rowwise", 3, 5, 7, E4, E4, True),
    ("one_by_one", 1, 1, 1, E4, E4, False),
    ("m_zero", 0, 32, 16, E4, E4, False),
    ("n_zero", 16, 32, 0, E4, E4, False),
    ("k_zero", 16, 0, 16, E4, E4, False),
]


def _operands(m, k, n, da, db, rowwise):
    a, b = _f8(m, k, dtype=da), _f8(k, n, dtype=db, seed=1)
    if rowwise:
        torch.manual_seed(2)
        return a, b, torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5
    return a, b, torch.tensor(0.75), torch.tensor(1.5)


@pytest.mark.parametrize(
    ("m", "k", "n", "da", "db", "rowwise"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED]
)
def test_accepted_products_are_the_definition(m, k, n, da, db, rowwise):
    a, b, sa, sb = _operands(m, k, n, da, db, rowwise)
    out = OP(a, b, sa, sb)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _definition(a, b, sa, sb), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("m", "k", "n", "da", "db", "rowwise"),
    [c[1:] for c in ACCEPTED if c[0] in ("tensorwise", "rowwise", "odd_sizes", "m_zero")],
    ids=["tensorwise", "rowwise", "odd_sizes", "m_zero"],
)
def test_meta_and_fake_shapes_are_the_real_ones(m, k, n, da, db, rowwise):
    args = _operands(m, k, n, da, db, rowwise)
    real = OP(*args)
    assert OP(*(t.to("meta") for t in args)).shape == real.shape
    with FakeTensorMode() as mode:
        assert OP(*(mode.from_tensor(t) for t in args)).shape == real.shape


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_opcheck_fake_and_dispatch(rowwise):
    # test_schema compares FP8 inputs with ops CPU lacks for FP8 (torch's, not the op's): left out.
    args = _operands(16, 32, 16, E4, E4, rowwise)
    result = torch.library.opcheck(
        OP, args, test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    )
    assert set(result.values()) == {"SUCCESS"}


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_compiled_equals_eager(fresh_dynamo, rowwise):
    args = _operands(16, 32, 16, E4, E4, rowwise)
    compiled = torch.compile(lambda a, b, sa, sb: OP(a, b, sa, sb), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(*args), OP(*args))


def test_compiled_dynamic_rows_one_graph(fresh_dynamo):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(lambda a, b: OP(a, b, ONE, ONE), backend=counter, fullgraph=True, dynamic=True)
    b = _f8(32, 16)
    for m in (3, 5, 9):
        a = _f8(m, 32)
        assert torch.equal(compiled(a, b), OP(a, b, ONE, ONE))
    assert counter.frame_count == 1


def test_nan_operand_reaches_its_row_as_in_torch():
    a, b = _f8(4, 32), _f8(32, 16)
    a[1, 3] = float("nan")
    out, ref = OP(a, b, ONE, ONE), TORCH_SCALED_MM(a, b, ONE, ONE, out_dtype=torch.float32)
    assert torch.equal(out.isnan(), ref.isnan()) and out[1].isnan().all() and not out[0].isnan().any()


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_scale_stays_non_finite(value):
    out = OP(_f8(4, 32), _f8(32, 16), torch.tensor(value), ONE)
    assert not torch.isfinite(out).any()


def test_transposed_operands_match_torch_on_the_same_layout():
    # The op keeps the layouts it is given (bits depend on them), as torch's CPU kernel does.
    a, b = _f8(32, 16).t(), _f8(16, 32, seed=1).t()
    ref = TORCH_SCALED_MM(a, b, ONE, ONE, out_dtype=torch.float32)
    torch.testing.assert_close(OP(a, b, ONE, ONE), ref, rtol=1e-6, atol=1e-5)


# ------------------------------------------------------- checkpoint formats


def _round_trip(obj, weights_only: bool = True):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _same(a: Float8Tensor, b: Float8Tensor) -> bool:
    return (
        type(a) is type(b)
        and torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8))
        and torch.equal(
            a._scale.view(torch.uint8) if a._scale.element_size() == 1 else a._scale,
            b._scale.view(torch.uint8) if b._scale.element_size() == 1 else b._scale,
        )
        and a._block == b._block
        and a._orig_dtype == b._orig_dtype
        and a._gemm == b._gemm
    )


GRANULARITIES = [
    ("tensorwise", "tensorwise", E4),
    ("rowwise", "rowwise", E4),
    ("e5m2", "tensorwise", E5),
    ("block_128", BLOCK_128x128, E4),
    ("mx_1x32", MX_1x32, E4),
]


@pytest.mark.parametrize("how", ["torch_load", "torch_load_full", "deepcopy", "pickle"])
@pytest.mark.parametrize(("granularity", "dtype"), [g[1:] for g in GRANULARITIES], ids=[g[0] for g in GRANULARITIES])
def test_current_format_round_trips_bit_for_bit(granularity, dtype, how):
    torch.manual_seed(0)
    x8 = Float8Tensor.from_hp(torch.randn(128, 128, dtype=torch.bfloat16), dtype, granularity=granularity)
    if how == "torch_load":
        back = _round_trip(x8)
    elif how == "torch_load_full":
        back = _round_trip(x8, weights_only=False)
    elif how == "deepcopy":
        back = copy.deepcopy(x8)
    else:
        back = pickle.loads(pickle.dumps(x8))
    assert _same(back, x8)


def test_parameter_of_the_current_format_round_trips():
    p = torch.nn.Parameter(Float8Tensor.from_hp(torch.randn(16, 16), granularity="rowwise"), requires_grad=False)
    back = _round_trip({"w": p})["w"]
    assert isinstance(back, torch.nn.Parameter) and not back.requires_grad and _same(back, p)


class _Crafted:
    def __init__(self, reduce):
        self.reduce = reduce

    def __reduce_ex__(self, protocol):
        return self.reduce


def _entry(version):
    fields = Float8Tensor.from_hp(torch.randn(4, 16))._serial_fields()
    return _Crafted((_rebuild_float8_tensor, (version, fields)))


def test_format_1_is_refused_naming_the_tag_that_reads_it():
    with pytest.raises(ValueError, match=rf"git tag '{LEGACY_TAG}'"):
        _rebuild_float8_tensor(1, {})
    with pytest.raises(Exception, match="pre-release format"):
        _round_trip({"layer.weight": _entry(1)})


@pytest.mark.parametrize("version", [0, 3, -1, "2", 2.0, True], ids=["v0", "v3", "minus1", "str", "float", "bool"])
def test_other_format_numbers_are_refused(version):
    with pytest.raises(ValueError, match=r"checkpoint format .* is not supported \(this f8tensor reads 2\)"):
        _rebuild_float8_tensor(version, Float8Tensor.from_hp(torch.randn(4, 16))._serial_fields())


@pytest.mark.parametrize("weights_only", [True, False], ids=["weights_only", "full_unpickler"])
def test_format_0_inside_a_state_dict_is_refused(weights_only, tmp_path):
    nested = tmp_path / "nested.pt"
    with open(FIXTURE_V0, "rb") as f:
        nested.write_bytes(f.read())
    with pytest.raises(Exception, match="pre-release format"):
        torch.load(nested, weights_only=weights_only)


def test_retired_message_says_how_to_convert():
    assert LEGACY_TAG in RETIRED_FORMAT and "save it again" in RETIRED_FORMAT
    assert _SERIAL_VERSION == 2


# What today's f8tensor saves loads with weights_only=True, after the retired formats left the safe globals.
STATE_DICTS = [
    ("tensorwise", False),
    ("tensorwise", True),
    ("delayed", False),
    ("delayed", True),
    ("mxfp8", True),
    ("nvfp4", False),
]


@pytest.mark.parametrize(("recipe", "all_gather"), STATE_DICTS, ids=[r + "_ag" * ag for r, ag in STATE_DICTS])
def test_layer_state_dict_loads_weights_only(recipe, all_gather):
    from f8tensor import Float8Linear, Float8LinearConfig

    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe(recipe, enable_fsdp_float8_all_gather=all_gather)
    layer = Float8Linear.from_float(torch.nn.Linear(32, 32), config)
    state = layer.state_dict()
    back = _round_trip(state)
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())


def test_fp8_moment_optimizer_state_loads_weights_only():
    import f8tensor.optim

    p = torch.nn.Parameter(torch.randn(256, 256))
    opt = f8tensor.optim.AdamW([p], lr=0.1, state_dtype=torch.float8_e4m3fn)
    p.grad = torch.randn(256, 256)
    opt.step()
    state = opt.state_dict()["state"][0]
    back = _round_trip(opt.state_dict())["state"][0]
    assert back.keys() == state.keys()
    assert all(torch.equal(_bits(back[k]), _bits(v)) for k, v in state.items() if isinstance(v, torch.Tensor))
