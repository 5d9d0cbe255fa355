"""The rules of the block-scaled, MX and grouped kernels, and the torch-version knowledge.

One test per rule row (``f8tensor/gemm/rules/``): the row says it, the checker
(``f8tensor/gemm/violations.py``) finds a call that breaks it, and the product refuses the call
at its entry (or pads it when the config asks), on CPU as on CUDA. Also the validation of
``float8_grouped_mm``'s arguments and what ``compat`` knows of each torch release.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from f8tensor import (
    BlockGranularity,
    Float8ExpertWeight,
    Float8LinearConfig,
    Float8Tensor,
    GemmConfig,
    compat,
    gemm,
    sqnr,
)
from f8tensor.gemm import blocks, grouped
from f8tensor.gemm.rules import (
    BLOCK_SCALED_MM_RULES,
    GROUPED_RULES,
    SUPPORTED_BUILDS,
    CudaBuild,
    block_rule_by_recipes,
    block_rule_for,
    grouped_rule_for,
)
from f8tensor.moe import _ExpertBmmFn, float8_grouped_mm
from tests.helpers import torch_reference_cpu_kernels

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DEEPSEEK = [r for r in BLOCK_SCALED_MM_RULES if r.recipe_a in ("BlockWise1x128", "BlockWise128x128")]
MXFP8 = next(r for r in BLOCK_SCALED_MM_RULES if r.name.startswith("MXFP8"))


def _block_operands(rule, m, k, n, dtype=E4M3):
    """Float8Tensor operands a (M, K), b (K, N) with ``rule``'s blocks, and the kernel call
    the CUDA branch would make for them (built by blocks.py's own code)."""
    scale_dtype = rule.scale_dtype
    a8 = Float8Tensor.from_hp(
        torch.randn(m, k), granularity=BlockGranularity(rule.block_a, scale_dtype), float8_dtype=dtype
    )
    b8 = Float8Tensor.from_hp(
        torch.randn(k, n), granularity=BlockGranularity(rule.block_b, scale_dtype), float8_dtype=dtype
    )
    return a8, b8


# ----------------------------------------------------------------------------- block-scaled rows


@pytest.mark.parametrize("rule", DEEPSEEK, ids=lambda r: r.name)
def test_deepseek_rows_refuse_fast_accumulation(rule):
    # cuBLASLt's get_scale_mode: "scaled_gemm doesn't support fast accum with 1x128 blockwise scaling".
    assert rule.fast_accum is False
    a8, b8 = _block_operands(rule, 128, 256, 128)
    args = blocks._kernel_args(rule, a8, b8)
    assert gemm.block_scaled_mm_violations(*args, rule) == []
    found = gemm.block_scaled_mm_violations(*args, rule, use_fast_accum=True)
    assert any("use_fast_accum" in f for f in found), found


def test_blockwise_recipe_forward_sends_no_fast_accumulation(cuda_rules):
    # The recipe asks for fast accumulation in its forward GEMM; the DeepSeek kernels take none.
    assert Float8LinearConfig.from_recipe("blockwise").use_fast_accum
    rule = block_rule_for((1, 128), (128, 128), torch.float32)
    a8, b8 = _block_operands(rule, 128, 256, 128)
    blocks.product(a8, b8, None, torch.bfloat16, GemmConfig(use_fast_accum=True))
    assert cuda_rules.take() == []


@pytest.mark.parametrize("rule", DEEPSEEK + [MXFP8], ids=lambda r: r.name)
def test_block_rows_need_k_and_n_multiples_of_16(rule):
    assert (rule.align_k, rule.align_n) == (16, 16)
    a8, b8 = _block_operands(rule, 208, 300, 260)  # M=208: a multiple of every row's align_m
    found = gemm.block_scaled_mm_violations(*blocks._kernel_args(rule, a8, b8), rule)
    assert any("K=300 is not a multiple of 16" in f for f in found), found
    assert any("N=260 is not a multiple of 16" in f for f in found), found
    # The product refuses the call at its entry, on CPU too, naming each dim and multiple.
    with pytest.raises(ValueError, match=r"K=300 \(a multiple of 16\), N=260 \(a multiple of 16\)"):
        blocks.product(a8, b8, None, torch.float32, GemmConfig())
    # ... or pads when asked: the padded kernel call is legal, the numbers are the reference's.
    pads = blocks._padding(rule, a8, b8, GemmConfig(pad_inner_dim=True), traced=False)
    assert pads == (0, 4, 12)
    assert gemm.block_scaled_mm_violations(*blocks._kernel_args(rule, a8, b8, pads), rule) == []
    out = blocks.product(a8, b8, None, torch.float32, GemmConfig(pad_inner_dim=True))
    assert torch.equal(out, a8.to_hp(torch.float32) @ b8.to_hp(torch.float32))


@pytest.mark.parametrize(
    ("rule", "m", "k", "n", "refused"),
    [
        (DEEPSEEK[0], 128, 320, 256, {"K"}),  # 1x128 x 128x128: K and N
        (DEEPSEEK[0], 208, 256, 208, {"N"}),  # M: a multiple of the 1x128 a's align_m (16)
        (DEEPSEEK[1], 208, 256, 208, set()),  # 1x128 x 1x128: K only
        (DEEPSEEK[1], 128, 64, 128, {"K"}),  # K // 128 == 0
        (DEEPSEEK[2], 200, 256, 208, {"M"}),  # 128x128 x 1x128: K and M
    ],
    ids=["1x128x128x128-K320", "1x128x128x128-N208", "1x128x1x128-free", "1x128x1x128-K64", "128x128x1x128-M200"],
)
def test_deepseek_compile_rules_of_torch_2_11_to_2_13(rule, m, k, n, refused):
    # torch.compile traces with _check_scaled_mm_sizes_v2, which floor-divides by 128 on 2.11-2.13.
    assert rule.compile_torch == ((2, 11), (2, 12), (2, 13))
    a8, b8 = _block_operands(rule, m, k, n)
    args = blocks._kernel_args(rule, a8, b8)
    assert gemm.block_scaled_mm_violations(*args, rule) == []  # eager takes it
    found = gemm.block_scaled_mm_violations(*args, rule, traced=True)
    assert {f.split(": ")[1].split("=")[0] for f in found} == refused, found


def test_deepseek_compile_rules_are_enforced_where_the_meta_asks(monkeypatch):
    rule = DEEPSEEK[0]
    a8, b8 = _block_operands(rule, 64, 320, 208)
    monkeypatch.setattr(compat, "META_FLOORS_BLOCK_SCALES", True)
    with pytest.raises(
        ValueError, match=r"K=320 \(a multiple of 128\), N=208 \(a multiple of 128\) under torch.compile"
    ):
        blocks._padding(rule, a8, b8, GemmConfig(), traced=True)
    pads = blocks._padding(rule, a8, b8, GemmConfig(pad_inner_dim=True), traced=True)
    assert pads == (0, 64, 48)
    args = blocks._kernel_args(rule, a8, b8, pads)
    assert gemm.block_scaled_mm_violations(*args, rule, traced=True) == []
    monkeypatch.setattr(compat, "META_FLOORS_BLOCK_SCALES", False)  # torch 2.14: shape-only meta
    assert blocks._padding(rule, a8, b8, GemmConfig(), traced=True) == (0, 0, 0)


def test_mxfp8_row_takes_e4m3fn_only():
    # check_mxfp8_recipe: both operands Float8_e4m3fn (the v2 path f8tensor calls).
    assert MXFP8.operand_dtypes == frozenset({E4M3})
    a8, b8 = _block_operands(MXFP8, 128, 64, 32, dtype=E5M2)
    found = gemm.block_scaled_mm_violations(*blocks._kernel_args(MXFP8, a8, b8), MXFP8)
    assert any("float8_e5m2 not in" in f for f in found), found


def test_fp4_rows_are_data_for_a_later_product():
    fp4 = torch.float4_e2m1fn_x2
    mx4 = block_rule_by_recipes("BlockWise1x32", "BlockWise1x32", fp4)
    nv4 = block_rule_by_recipes("BlockWise1x16", "BlockWise1x16", fp4)
    assert mx4.name.startswith("MXFP4") and nv4.name.startswith("NVFP4")
    assert block_rule_by_recipes("BlockWise1x32", "BlockWise1x32", E4M3) is MXFP8
    assert block_rule_for((1, 32), (32, 1), torch.float8_e8m0fnu) is MXFP8
    assert (mx4.k_per_element, nv4.k_per_element, nv4.scale_dtype) == (2, 2, E4M3)
    for rule in (mx4, nv4):
        assert not rule.fast_accum and rule.sources
        assert not any(b in rule.builds for b in SUPPORTED_BUILDS)  # sm100 only


def test_supported_builds_cover_every_torch_of_the_matrix():
    assert {b.torch_version for b in SUPPORTED_BUILDS} == {(2, 11), (2, 12), (2, 13), (2, 14)}


# ----------------------------------------------------------------------------- grouped rows


def test_grouped_fp8_kernel_is_sm90_only():
    for t in ((2, 11), (2, 14)):
        assert grouped_rule_for(CudaBuild(t, (12, 8), (9, 0))) is not None
        assert grouped_rule_for(CudaBuild(t, (12, 8), (10, 0))) is None  # host gate admits it, no kernel
        assert grouped_rule_for(CudaBuild(t, (12, 8), (8, 9))) is None


def _grouped_call(m=64, k=32, n=48, g=4, form="2Dx3D"):
    a = torch.zeros(m, k, dtype=E4M3)
    if form == "2Dx3D":
        b = torch.zeros(g, n, k, dtype=E4M3).transpose(-2, -1)
        offs = torch.linspace(0, m, g + 1)[1:].to(torch.int32)
        return a, b, torch.ones(m), torch.ones(g, n), offs
    a = torch.zeros(g, m, k, dtype=E4M3)
    b = torch.zeros(g, n, k, dtype=E4M3).transpose(-2, -1)
    return a, b, torch.ones(g, m), torch.ones(g, n), None


def test_grouped_checker_n_multiple_of_16_in_every_form():
    rule = GROUPED_RULES[0]
    assert rule.align == 16
    for form in ("2Dx3D", "3Dx3D"):
        assert gemm.grouped_mm_violations(*_grouped_call(form=form), torch.bfloat16) == []
        found = gemm.grouped_mm_violations(*_grouped_call(n=40, form=form), torch.bfloat16)
        assert any("N (b.size(-1))=40 is not a multiple of 16" in f for f in found), found


def test_grouped_checker_fewer_than_1024_groups():
    assert GROUPED_RULES[0].max_groups == 1023
    assert gemm.grouped_mm_violations(*_grouped_call(m=2, g=1023, form="3Dx3D"), torch.bfloat16) == []
    found = gemm.grouped_mm_violations(*_grouped_call(m=2, g=1024, form="3Dx3D"), torch.bfloat16)
    assert any("1024 groups" in f for f in found), found


def test_grouped_checker_offs_values_on_the_host():
    a, b, sa, sb, _ = _grouped_call(m=64, g=4)
    for bad in ([16, 8, 32, 64], [16, 32, 48, 80], [-1, 16, 32, 64]):
        found = gemm.grouped_mm_violations(a, b, sa, sb, torch.tensor(bad, dtype=torch.int32), torch.bfloat16)
        assert any("offs must" in f for f in found), (bad, found)


def test_grouped_n_not_multiple_of_16_fails_in_forward():
    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(2, 32, 33, requires_grad=True)
    with pytest.raises(ValueError, match=r"N \(output\)=33; each must be a multiple of 16"):
        float8_grouped_mm(x, w, torch.tensor([4, 8], dtype=torch.int32))


def test_batched_n_not_multiple_of_16_fails_in_forward():
    x, w = torch.randn(2, 4, 32), torch.randn(2, 32, 33)
    with pytest.raises(ValueError, match="contraction dim must be a multiple of 16"):
        _ExpertBmmFn.apply(x, w, Float8LinearConfig())


def test_batched_mm_with_1024_entries_or_more_runs_in_legal_calls(monkeypatch):
    sizes = []
    real = grouped.scaled_grouped_mm

    def spy(a, b, *args):
        sizes.append(a.shape[0])
        return real(a, b, *args)

    monkeypatch.setattr(grouped, "scaled_grouped_mm", spy)
    a, b = torch.randn(1030, 1, 16), torch.randn(1030, 16, 16)
    cfg = Float8LinearConfig()
    out = _ExpertBmmFn.apply(a, b, cfg)
    assert sizes == [1023, 7]
    assert out.shape == (1030, 1, 16)
    ref = torch.bmm(a, b)
    assert float((out - ref).norm() / ref.norm()) < 0.1


def test_weight_gradient_form_zeroes_empty_groups_on_the_kernel_path(monkeypatch):
    # The kernel's output comes from empty_strided: an empty group is not provably written.
    monkeypatch.setattr(grouped, "grouped_kernel_available", lambda device: True)
    monkeypatch.setattr(
        compat,
        "scaled_grouped_mm",
        lambda a, b, sa, sb, offs, out: torch.full((offs.shape[0], a.shape[0], b.shape[1]), float("nan"), dtype=out),
    )
    k, n = 32, 16
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)  # group 1 is empty
    a, b = torch.zeros(k, 48, dtype=E4M3), torch.zeros(n, 48, dtype=E4M3).t()  # (K, P) row-, (P, N) column-major
    out = grouped.scaled_grouped_mm(a, b, torch.ones(3 * k), torch.ones(3 * n), offs, torch.bfloat16)
    assert torch.equal(out[1], torch.zeros(k, n, dtype=torch.bfloat16))
    assert out[0].isnan().all() and out[2].isnan().all()


# ----------------------------------------------------------------------------- float8_grouped_mm arguments


def _xw(m=8, k=32, n=16, g=2, dtype=torch.float32):
    return torch.randn(m, k, dtype=dtype), torch.randn(g, k, n, dtype=dtype)


@pytest.mark.parametrize("bad", [[4, 2], [4, 9], [-1, 8]], ids=["decreasing", "past-M", "negative"])
def test_grouped_offs_values_refused(bad):
    x, w = _xw()
    with pytest.raises(ValueError, match="non-decreasing cumulative counts"):
        float8_grouped_mm(x, w, torch.tensor(bad))


def test_grouped_offs_as_a_list_is_accepted():
    x, w = _xw()
    assert torch.equal(
        float8_grouped_mm(x, w, [3, 8]), float8_grouped_mm(x, w, torch.tensor([3, 8], dtype=torch.int32))
    )
    assert torch.equal(float8_grouped_mm(x, w, (3, 8)), float8_grouped_mm(x, w, torch.tensor([3, 8])))
    with pytest.raises(TypeError, match="offs"):
        float8_grouped_mm(x, w, [3.0, 8.0])
    with pytest.raises(TypeError, match="integer tensor"):
        float8_grouped_mm(x, w, torch.tensor([3.0, 8.0]))
    with pytest.raises(ValueError, match="offs"):
        float8_grouped_mm(x, w, [8])


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(torch.int32, "integer"), (torch.bool, "bool"), (E4M3, "FP8"), (torch.complex64, "complex")],
)
def test_grouped_activation_dtypes_refused_by_name(dtype, name):
    x, w = _xw()
    x = torch.zeros(x.shape, dtype=dtype)
    with pytest.raises(TypeError, match=f"x is an? {name} tensor"):
        float8_grouped_mm(x, w, [4, 8])


def test_grouped_weight_dtype_and_config_type_refused():
    x, w = _xw()
    with pytest.raises(TypeError, match="w is an integer tensor"):
        float8_grouped_mm(x, w.to(torch.int64), [4, 8])
    with pytest.raises(TypeError, match="config must be a Float8LinearConfig"):
        float8_grouped_mm(x, w, [4, 8], config="tensorwise")


@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_grouped_delayed_config_refused_not_run_dynamic(role):
    # Experts keep no amax history: a delayed cast ran as a dynamic one, silently, before.
    x, w = _xw()
    delayed = Float8LinearConfig.from_recipe("delayed")
    config = Float8LinearConfig(**{role: getattr(delayed, role)})
    with pytest.raises(ValueError, match="delayed scaling is not supported for expert GEMMs"):
        float8_grouped_mm(x, w, [4, 8], config=config)


def test_grouped_product_honours_per_gemm_formats():
    # A forward in high precision: the grouped kernel cast it to FP8 anyway, silently; the
    # per-expert loop runs Float8Linear's GEMMs, formats included.
    x, w = _xw(m=32, k=32, n=32)
    hp_forward = Float8LinearConfig().with_gemm_formats({("forward", "input"): None, ("forward", "weight"): None})
    reference = torch.cat([x[:16] @ w[0], x[16:] @ w[1]])
    assert sqnr(float8_grouped_mm(x, w, [16, 32], hp_forward), reference) >= 100  # measured: exact
    assert sqnr(float8_grouped_mm(x, w, [16, 32]), reference) < 40  # FP8: ~30 dB


def test_compiled_grouped_product_follows_a_switch_to_per_gemm_formats(fresh_dynamo):
    # Traced, the path is a constant per config: a switched config must still take the loop.
    x, w = _xw(m=32, k=32, n=32)
    holder = torch.nn.Module()
    holder.config = Float8LinearConfig()
    compiled = torch.compile(lambda x: float8_grouped_mm(x, w, [16, 32], holder.config), backend="eager")
    compiled(x)
    holder.config = Float8LinearConfig().with_gemm_formats({("forward", "input"): None, ("forward", "weight"): None})
    assert torch.equal(compiled(x), float8_grouped_mm(x, w, [16, 32], holder.config))


def test_expert_weight_with_a_delayed_config_refused():
    # Its bmm ran dynamic casts silently, its F.linear failed an assert, before.
    delayed = Float8LinearConfig.from_recipe("delayed")
    with pytest.raises(ValueError, match="Float8ExpertWeight: delayed scaling is not supported"):
        Float8ExpertWeight(torch.randn(2, 32, 16), delayed)


def test_grouped_delayed_config_refused_after_a_compiled_dynamic_call(fresh_dynamo):
    # Traced, the check is a constant per config (no guard on its fields): a config switched
    # to delayed must still reach it.
    x, w = _xw()
    holder = torch.nn.Module()
    holder.config = Float8LinearConfig()
    compiled = torch.compile(lambda x: float8_grouped_mm(x, w, [4, 8], holder.config), backend="eager")
    compiled(x)
    holder.config = Float8LinearConfig(input=Float8LinearConfig.from_recipe("delayed").input)
    with pytest.raises(ValueError, match="delayed scaling is not supported for expert GEMMs"):
        compiled(x)


def test_offs_values_on_a_device_are_asserted_without_a_sync(monkeypatch):
    seen = []
    monkeypatch.setattr(compat, "assert_async", lambda cond, msg: seen.append((bool(cond), msg)))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as under torch.compile
    x, w = _xw()
    grouped.validate_grouped_mm_args(x, w, torch.tensor([4, 9]), Float8LinearConfig())
    assert seen and seen[0][0] is False and "offs" in seen[0][1]


def test_assert_async_raises_on_cpu():
    with pytest.raises(RuntimeError):
        compat.assert_async(torch.tensor(False), "offs out of range")


# ----------------------------------------------------------------------------- compat: what each torch has


def test_compat_knows_each_release():
    v = compat.TORCH_VERSION
    assert v == tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert compat.HAS_CPU_ROWWISE_SCALED_MM == (v >= (2, 12))
    assert compat.HAS_CPU_SCALED_MM_V2 == (v >= (2, 12))
    assert compat.META_FLOORS_BLOCK_SCALES == (v < (2, 14))
    assert compat.HAS_GROUPED_MM_FP32_META is False


@pytest.mark.parametrize("products_in_fp32", [True, False])
def test_rowwise_on_a_cpu_without_the_rowwise_kernel_matches_the_postscale_route(monkeypatch, products_in_fp32):
    # CPU_PRODUCTS_IN_FP32 False (the benchmarks' graphs) sends torch's kernel only what it
    # takes: torch 2.11's refused the rowwise product (an internal assert).
    monkeypatch.setattr(compat, "CPU_PRODUCTS_IN_FP32", products_in_fp32)
    m, k, n = 32, 64, 48
    a = torch.randn(m, k).to(E4M3)
    b = torch.randn(n, k).to(E4M3).t()
    sa, sb = torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5
    bias = torch.randn(n, dtype=torch.bfloat16)
    monkeypatch.setattr(compat, "HAS_CPU_ROWWISE_SCALED_MM", False)
    out = compat.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    one = torch.ones(())
    acc = compat.scaled_mm(a, b, one, one, out_dtype=torch.float32)
    assert torch.equal(out, (acc * sa * sb + bias.float()).to(torch.bfloat16))
    exact = a.float() @ b.float() * sa * sb + bias.float()
    assert torch.allclose(out.float(), exact, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("m", "k", "n"), [(16, 64, 32), (112, 128, 48)])
def test_cpu_per_tensor_product_is_torchs_reference_kernel_bitwise(m, k, n, with_bias, out_dtype):
    # On a CPU, compat.scaled_mm computes per-tensor products itself (torch would hand them to
    # oneDNN on CPUs with AMX, ~400x slower): the bits of torch's reference CPU kernel, which
    # torch runs with oneDNN switched off.
    torch.manual_seed(0)
    a = (torch.randn(m, k) * 3).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k) * 3).to(torch.float8_e5m2).t()
    sa, sb = torch.tensor(0.37), torch.tensor(1.7)
    bias = torch.randn(n, dtype=out_dtype) if with_bias else None
    with torch_reference_cpu_kernels():
        reference = compat._SCALED_MM(a, b, sa, sb, bias=bias, out_dtype=out_dtype)  # the original, unchecked
    with _OpsSeen() as seen:
        out = compat.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    assert torch.equal(out, reference)
    assert torch.ops.aten._scaled_mm.default not in seen.ops  # torch's kernel (oneDNN here) is not asked
    assert torch.ops.f8tensor.cpu_scaled_mm.default in seen.ops  # one op for the product, eager and compiled


class _OpsSeen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))
