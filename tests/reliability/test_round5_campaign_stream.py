"""Round 5 campaign: ``fp8_state_dict`` / ``iter_fp8_weights``, the in-memory export.

The reference is the file ``save_fp8_pretrained`` writes with the same arguments, read back with
safetensors: same names, dtypes, shapes and bytes. High-precision tensors are the model's own
(the docstring): they follow the model; FP8 tensors are made when their layer starts.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from round5_checkpoints import quiet
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from f8tensor import Float8LinearConfig, Float8Tensor, convert_to_float8_training
from f8tensor.export import fp8_state_dict, iter_fp8_weights, load_fp8_pretrained, save_fp8_pretrained
from f8tensor.export.frozen import FrozenFloat8Linear
from f8tensor.quant.specs import Granularity

VOCAB = 256
TOKENS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
EXPORTS = [
    ("fp8_block", None),
    ("mxfp8", None),
    ("compressed_tensors", "tensor"),
    ("compressed_tensors", "channel"),
    ("compressed_tensors", "block"),
]
EXPORT_IDS = [s or f for f, s in EXPORTS]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def _quiet():
    with quiet():
        yield


def llama(dtype=torch.bfloat16, *, tied=True, layers=1, seed=0):
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype)


def converted(recipe="rowwise", **kw):
    model = llama(**kw)
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe(recipe), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    return model


def read_file(directory) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        g = got[key]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), key
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), key


def written(model, path, fmt="fp8_block", strategy=None, **kw) -> dict[str, torch.Tensor]:
    save_fp8_pretrained(model, path, format=fmt, strategy=strategy, **kw)
    return read_file(path)


def snapshot(pairs) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pairs}


# ---------------------------------------------------------------- equal to the file


@pytest.mark.parametrize(("fmt", "strategy"), EXPORTS, ids=EXPORT_IDS)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plain_model_state_dict_is_the_file(tmp_path, dtype, tied, fmt, strategy):
    model = llama(dtype, tied=tied)
    state = fp8_state_dict(model, format=fmt, strategy=strategy)
    assert_same(state, written(model, tmp_path / "out", fmt, strategy))
    assert ("lm_head.weight" in state) is (not tied)
    assert state["model.norm.weight"].dtype == dtype


@pytest.mark.parametrize(("fmt", "strategy"), EXPORTS, ids=EXPORT_IDS)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_converted_model_state_dict_is_the_file(tmp_path, recipe, fmt, strategy):
    model = converted(recipe, dtype=torch.float32, tied=False)
    assert_same(fp8_state_dict(model, format=fmt, strategy=strategy), written(model, tmp_path / "o", fmt, strategy))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_iterator_yields_the_dict_in_the_files_order_once(dtype):
    model = converted(dtype=dtype)
    pairs = list(iter_fp8_weights(model))
    names = [k for k, _ in pairs]
    assert len(names) == len(set(names))
    assert_same(dict(pairs), fp8_state_dict(model))
    # each scale right after its weight
    for i, name in enumerate(names):
        if name.endswith("_scale_inv"):
            assert names[i - 1] == name.removesuffix("_scale_inv")


@pytest.mark.parametrize(("fmt", "strategy"), [("fp8_block", None), ("compressed_tensors", "channel")])
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_model_loaded_from_an_fp8_checkpoint_exports_the_file(tmp_path, dtype, frozen, fmt, strategy):
    source = converted("blockwise" if strategy is None else "rowwise", tied=False, dtype=dtype)
    original = written(source, tmp_path / "a", fmt, strategy)
    loaded = load_fp8_pretrained(llama(dtype, tied=False, seed=1), str(tmp_path / "a"), frozen=frozen)
    assert any(isinstance(m, FrozenFloat8Linear) for m in loaded.modules()) is frozen
    state = fp8_state_dict(loaded, format=fmt, strategy=strategy)
    assert_same(state, written(loaded, tmp_path / "b", fmt, strategy))
    if frozen:
        assert_same(state, original)  # the file's own bytes round trip


def test_frozen_model_exported_in_another_format_is_the_file(tmp_path):
    source = converted("blockwise", tied=False)
    written(source, tmp_path / "a")
    loaded = load_fp8_pretrained(llama(tied=False, seed=1), str(tmp_path / "a"))
    state = fp8_state_dict(loaded, format="compressed_tensors", strategy="channel")
    assert_same(state, written(loaded, tmp_path / "b", "compressed_tensors", "channel"))


def test_tied_head_shares_the_embedding_and_is_left_out():
    model = llama(tied=True)
    state = fp8_state_dict(model)
    assert "lm_head.weight" not in state
    assert state["model.embed_tokens.weight"].data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_fp8_weight_is_the_cast_of_the_master_from_the_definition():
    model = converted(dtype=torch.float32)
    state = fp8_state_dict(model, format="compressed_tensors", strategy="channel")
    key = "model.layers.0.mlp.down_proj.weight"
    w = model.get_parameter(key).detach()
    t = Float8Tensor.from_hp(w, granularity=Granularity.ROWWISE)
    assert torch.equal(state[key].view(torch.uint8), t._data.view(torch.uint8))
    assert torch.equal(state[key + "_scale"].reshape(-1), torch.reciprocal(t._scale.float()).reshape(-1))


# ---------------------------------------------------------------- generator state


def test_abandoned_iterator_leaves_grad_mode_and_the_model_alone():
    model = converted(layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    weights = iter_fp8_weights(model)
    for _ in range(5):
        next(weights)
    assert torch.is_grad_enabled()
    weights.close()
    assert torch.is_grad_enabled()
    assert [p.requires_grad for p in model.parameters()] == flags
    assert_same(model.state_dict(), before)
    model(TOKENS, labels=TOKENS).loss.backward()  # still trains


def test_caller_no_grad_is_kept_across_items():
    model = llama()
    with torch.no_grad():
        for _ in iter_fp8_weights(model):
            assert not torch.is_grad_enabled()
    with torch.enable_grad():
        for _ in iter_fp8_weights(model):
            assert torch.is_grad_enabled()


def test_error_midway_leaves_grad_mode_alone():
    model = llama(layers=2)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    weights = iter_fp8_weights(model)
    first = next(weights)
    assert first[0] == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight holds non-finite"):
        for _ in weights:
            pass
    assert torch.is_grad_enabled()


def test_two_interleaved_iterators_are_each_the_file(tmp_path):
    model = converted(tied=False)
    a = iter_fp8_weights(model, format="fp8_block")
    b = iter_fp8_weights(model, format="compressed_tensors", strategy="tensor")
    got_a, got_b = {}, {}
    for (ka, va), (kb, vb) in zip(a, b):
        got_a[ka], got_b[kb] = va.clone(), vb.clone()
    got_a.update(snapshot(a))
    got_b.update(snapshot(b))
    assert_same(got_a, written(model, tmp_path / "a"))
    assert_same(got_b, written(model, tmp_path / "b", "compressed_tensors", "tensor"))


def test_a_second_iterator_while_the_first_is_held_is_equal():
    model = converted()
    first = iter_fp8_weights(model)
    next(first)
    assert_same(dict(iter_fp8_weights(model)), fp8_state_dict(model))
    assert_same(
        dict([*snapshot(first).items()]),
        {k: v for k, v in fp8_state_dict(model).items() if k != "model.embed_tokens.weight"},
    )


def train_step(model, opt):
    model(TOKENS, labels=TOKENS).loss.backward()
    opt.step()
    opt.zero_grad()


def test_training_between_layers_high_precision_follow_fp8_snapshot():
    """HP tensors are the model's own (not copies): a step moves them. FP8 tensors are made
    when their layer starts: those of a layer already yielded stay the cast of the old weights."""
    model = converted(dtype=torch.float32, layers=2, tied=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    old = snapshot(fp8_state_dict(model).items())
    weights = iter_fp8_weights(model)
    got = {}
    for key, t in weights:
        got[key] = t
        if key.startswith("model.layers.0.") and key.endswith("down_proj.weight_scale_inv"):
            break
    train_step(model, opt)
    got.update(weights)
    new = fp8_state_dict(model)
    emb = "model.embed_tokens.weight"
    assert got[emb].data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(got[emb], new[emb]) and not torch.equal(old[emb], new[emb])
    layer0 = "model.layers.0.mlp.up_proj.weight"
    layer1 = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(got[layer0].view(torch.uint8), old[layer0].view(torch.uint8))
    assert not torch.equal(old[layer0].view(torch.uint8), new[layer0].view(torch.uint8))
    assert torch.equal(got[layer1].view(torch.uint8), new[layer1].view(torch.uint8))


def test_state_dict_high_precision_entries_are_the_models_own():
    model = llama(torch.float32, tied=False)
    state = fp8_state_dict(model)
    with torch.no_grad():
        model.model.norm.weight.add_(1)
    assert torch.equal(state["model.norm.weight"], model.model.norm.weight)
    assert not state["model.norm.weight"].requires_grad


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("api", [fp8_state_dict, iter_fp8_weights], ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"format": "fp8"}, ValueError, r"format must be one of .*'fp8'"),
        ({"format": None}, ValueError, r"format must be one of .*None"),
        ({"strategy": "channel"}, ValueError, r"strategy= applies to format='compressed_tensors' only"),
        ({"format": "compressed_tensors", "strategy": "row"}, ValueError, r"strategy must be one of .*'row'"),
        ({"scale_fmt": "e8m0"}, ValueError, r"scale_fmt must be None, or one of \('ue8m0',\)"),
        ({"format": "mxfp8", "scale_fmt": "ue8m0"}, ValueError, r"scale_fmt must be None.*format='mxfp8'"),
        ({"scale_fmt": "ue8m0"}, ValueError, r"is not cast with power_of_2_scale=True"),
    ],
)
def test_bad_arguments_name_the_function_and_the_value(api, kwargs, error, match):
    with pytest.raises(error, match=f"^{api.__name__}: .*{match}"):
        api(llama(), **kwargs)


@pytest.mark.parametrize("api", [fp8_state_dict, iter_fp8_weights], ids=lambda f: f.__name__)
def test_not_a_pretrained_model_is_refused_by_name(api):
    with pytest.raises(
        TypeError, match=f"^{api.__name__}: model must be a transformers PreTrainedModel .*; got Linear$"
    ):
        api(torch.nn.Linear(128, 128))


@pytest.mark.parametrize("gather", ["yes", 1, None])
def test_gather_must_be_a_bool(gather):
    with pytest.raises(TypeError, match=r"iter_fp8_weights: gather must be a bool"):
        iter_fp8_weights(llama(), gather=gather)


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError, match="positional argument"):
        fp8_state_dict(llama(), "fp8_block")  # type: ignore[misc]


def test_float64_weight_is_refused_by_name():
    model = llama(torch.float64)
    with pytest.raises(TypeError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        fp8_state_dict(model)


def test_non_finite_weight_in_a_converted_model_is_refused_by_name():
    model = converted()
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight[1, 2] = float("-inf")
    with pytest.raises(ValueError, match=r"fp8_state_dict: model\.layers\.0\.mlp\.gate_proj\.weight holds non-finite"):
        fp8_state_dict(model)


@pytest.mark.parametrize("api", [fp8_state_dict, iter_fp8_weights], ids=lambda f: f.__name__)
def test_meta_model_is_refused_by_name(api):
    with torch.device("meta"):
        model = llama()
    with pytest.raises(ValueError, match=f"^{api.__name__}: model.embed_tokens.weight is on the meta device"):
        dict(api(model))


def test_meta_model_save_is_refused_by_name_and_writes_nothing(tmp_path):
    with torch.device("meta"):
        model = llama()
    with pytest.raises(ValueError, match="^save_fp8_pretrained: model.embed_tokens.weight is on the meta device"):
        save_fp8_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("api", [fp8_state_dict, iter_fp8_weights], ids=lambda f: f.__name__)
def test_mxfp8_weight_with_k_not_a_multiple_of_32_is_refused_by_name(api):
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=200,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
        )
    )
    with pytest.raises(ValueError, match=f"^{api.__name__}: model.layers.0.mlp.down_proj.weight has N=128, K=200"):
        dict(api(model, format="mxfp8"))


def test_gather_false_on_a_plain_model_is_the_dict():
    model = converted()
    assert_same(dict(iter_fp8_weights(model, gather=False)), fp8_state_dict(model))


def test_frozen_model_trained_around_its_fp8_layers_exports_the_same_fp8_bytes(tmp_path):
    source = converted("blockwise", tied=False, dtype=torch.float32)
    original = written(source, tmp_path / "a")
    model = load_fp8_pretrained(llama(torch.float32, tied=False, seed=1), str(tmp_path / "a"))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    train_step(model, opt)
    state = fp8_state_dict(model)
    assert_same(state, written(model, tmp_path / "b"))
    fp8_keys = [k for k, v in original.items() if v.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv")]
    assert len(fp8_keys) == 14
    assert_same({k: state[k] for k in fp8_keys}, {k: original[k] for k in fp8_keys})
    assert not torch.equal(state["model.norm.weight"], original["model.norm.weight"])


def test_abandoned_iterator_keeps_no_made_tensor_alive():
    import gc
    import weakref

    model = converted(layers=2)
    weights = iter_fp8_weights(model)
    refs = []
    for key, t in weights:
        if t.dtype == torch.float8_e4m3fn:
            refs.append(weakref.ref(t))
            break
    del t
    gc.collect()
    # the rest of the layer is held by the suspended generator until it is dropped
    weights.close()
    del weights
    gc.collect()
    assert refs and all(r() is None for r in refs), key
