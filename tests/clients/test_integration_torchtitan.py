"""f8tensor inside torchtitan, on CPU, against torchtitan's own Llama 3 model code.

torchtitan's Trainer needs CUDA, but its model code builds and trains on a CPU: a
2-layer cut of its ``debugmodel`` flavour (dim 256, vocab 2048), attention through
torchtitan's SDPA module (its flex backend needs block masks built for a GPU run).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_sqnr
from torch import nn

from f8tensor import Float8Linear, convert_to_float8_training, sqnr

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'f8tensor[integrations]')")
# torchtitan's model package imports triton and spmd_types at import time.
# exc_type=ImportError: torchtitan 0.3.0 on torch < 2.12 fails with an ImportError that is
# not ModuleNotFoundError (it imports DataParallelMeshDims from torch.distributed.fsdp).
llama3 = pytest.importorskip(
    "torchtitan.models.llama3",
    reason=f"torchtitan's model code does not import with torch {torch.__version__}",
    exc_type=ImportError,
)

from torchtitan.config.override import OverrideConfig, apply_overrides
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.linear import Linear

from f8tensor.integrations.torchtitan import F8TensorLinear, F8TensorLinearConverter

pytestmark = pytest.mark.usefixtures("one_thread")

# bf16 model vs the same weights with FP8 linears (tensorwise), on a 2-layer model.
LOGITS_MIN_DB = 20.0
GRAD_MIN_DB = 15.0
STEPS = 4
LAYER_LINEARS = [
    f"layers.{i}.{name}"
    for i in range(2)
    for name in ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
]


def _config(converters=None):
    config = llama3.model_registry("debugmodel", converters=converters).model
    config.layers = config.layers[:2]
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def _build(config, state_dict=None) -> nn.Module:
    model = config.build()
    if state_dict is None:
        model.init_states(buffer_device=torch.device("cpu"))
    else:
        model.load_state_dict(state_dict)
    return model


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = _build(_config())
    return copy.deepcopy(model.state_dict()), model


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(seed))


def _bf16(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model under bf16 autocast over fp32 master weights: the bf16 twin of training."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(tokens).float()


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = _bf16(model, tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def test_converter_swaps_the_block_linears_and_keeps_lm_head(reference):
    state, _ = reference
    converter_cfg = F8TensorLinearConverter.Config(recipe="rowwise")
    model = _build(_config([converter_cfg]), state)
    fp8 = sorted(n for n, m in model.named_modules() if isinstance(m, F8TensorLinear))
    assert fp8 == sorted(LAYER_LINEARS)
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in fp8)
    assert type(model.lm_head) is Linear  # filter_fqns defaults to ["lm_head", "output"]
    assert model.get_submodule(fp8[0]).config.input.rowwise


def test_converter_recipe_and_filter_options():
    with pytest.raises(ValueError, match="unknown f8tensor recipe 'fp4'"):
        F8TensorLinearConverter.Config(recipe="fp4").build()
    converter = F8TensorLinearConverter.Config(recipe="delayed", filter_fqns=["wo", "lm_head"]).build()
    converter.convert(_config())
    assert converter.converted_fqns == [n for n in LAYER_LINEARS if not n.endswith("wo")]
    assert converter.float8_config.any_delayed


def test_forward_backward_parity_with_bf16_and_a_few_steps(reference):
    state, ref = reference
    model = _build(_config([F8TensorLinearConverter.Config(recipe="tensorwise")]), state)
    tokens = _tokens(1)
    ref_logits, logits = _bf16(ref, tokens), _bf16(model, tokens)
    assert_sqnr(ref_logits, logits, LOGITS_MIN_DB, "logits vs bf16")
    ref_loss, loss = _loss(ref, tokens), _loss(model, tokens)
    ref_loss.backward()
    loss.backward()
    for name in (
        "layers.0.feed_forward.w2.weight",
        "layers.1.attention.qkv_linear.wqkv.weight",
        "tok_embeddings.weight",
    ):
        assert_sqnr(ref.get_parameter(name).grad, model.get_parameter(name).grad, GRAD_MIN_DB, f"grad of {name}")
    ref.zero_grad(set_to_none=True)

    # A few AdamW steps on one batch: the FP8 model's loss falls as the bf16 one does.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt.zero_grad(set_to_none=True)
    losses = []
    for _ in range(STEPS):
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_override_registered_under_its_own_name(reference):
    state, _ = reference
    config = _config()
    lines = apply_overrides(
        OverrideConfig(imports=[("f8tensor.integrations.torchtitan.f8tensor_float8_linear", {"recipe": "rowwise"})]),
        config,
    )
    assert len(lines) == len(LAYER_LINEARS)
    model = _build(config, state)
    assert sorted(n for n, m in model.named_modules() if isinstance(m, F8TensorLinear)) == sorted(LAYER_LINEARS)
    assert type(model.lm_head) is Linear


def test_convert_to_float8_training_on_a_built_torchtitan_model(reference):
    # torchtitan's Linear subclasses nn.Linear and keeps its forward: the module-level
    # converter takes it too, and the layers keep torchtitan's Module protocol.
    state, ref = reference
    model = _build(_config(), state)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    assert sorted(model.float8_converted_fqns) == sorted(LAYER_LINEARS)
    layer = model.get_submodule(LAYER_LINEARS[0])
    assert isinstance(layer, Float8Linear) and isinstance(layer, Linear)
    model.init_states(buffer_device=torch.device("cpu"))  # torchtitan's init still walks them
    model.load_state_dict(state)
    tokens = _tokens(2)
    assert sqnr(_bf16(ref, tokens), _bf16(model, tokens)) >= LOGITS_MIN_DB


def _qwen3_moe_config():
    from torchtitan.models import qwen3

    config = qwen3.model_registry("debugmodel_moe").model
    config.layers = config.layers[:2]
    return config


def _linear_kinds(config) -> dict[str, str]:
    return {fqn: type(cfg).__name__ for fqn, cfg, _, _ in config.traverse(Linear.Config)}


def test_router_gates_stay_high_precision_by_default():
    """An FP8 router flips top-k expert choices: neither way in converts router gates unless asked."""
    gates = ["layers.0.moe.router.gate", "layers.1.moe.router.gate"]
    converter = F8TensorLinearConverter.Config(recipe="rowwise").build()
    config = converter.convert(_qwen3_moe_config())
    kinds = _linear_kinds(config)
    assert [kinds[g] for g in gates] == ["Config", "Config"]
    assert type(config.layers[0].moe.router.gate) is Linear.Config
    assert not any("router" in fqn for fqn in converter.converted_fqns)
    assert sorted(converter.converted_fqns) == sorted(
        f"layers.{i}.attention.{n}" for i in range(2) for n in ("qkv_linear.wqkv", "wo")
    )

    opted_in = F8TensorLinearConverter.Config(recipe="rowwise", convert_routers=True).build()
    opted_in.convert(_qwen3_moe_config())
    assert set(gates) <= set(opted_in.converted_fqns)

    config = _qwen3_moe_config()
    lines = apply_overrides(
        OverrideConfig(imports=[("f8tensor.integrations.torchtitan.f8tensor_float8_linear", {"recipe": "rowwise"})]),
        config,
    )
    assert len(lines) == 4 and not any("router" in line for line in lines), lines
    assert type(config.layers[1].moe.router.gate) is Linear.Config
