"""iter_fp8_weights under FSDP2 and tensor parallel, 2 ranks on CPU (gloo).

Every rank builds the same converted Llama and takes its export in one process first (the
reference); then the model is sharded. ``gather=True`` must give the reference bit for bit;
``gather=False`` each rank's piece, which the test puts back together along the sharded
dimension into the reference, or a refusal naming the first weight whose piece cuts a scale
block.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, init_gloo, run_processes

pytest.importorskip("transformers")

WORLD = 2
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from f8tensor import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    config = Float8LinearConfig.from_recipe("blockwise", pad_inner_dim=True, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    return model


def _plain(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def _attempt(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (reported by the test)
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}


def _fsdp(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from f8tensor.export import fp8_state_dict, iter_fp8_weights

    model = _model()
    ref = {fmt: _plain(fp8_state_dict(model, **kw)) for fmt, kw in _FORMATS.items()}
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out = {"ref": ref}
    for fmt, kw in _FORMATS.items():
        out[("gather", fmt)] = _attempt(lambda kw=kw: _plain(fp8_state_dict(model, **kw)))
        out[("local", fmt)] = _attempt(lambda kw=kw: _plain(dict(iter_fp8_weights(model, gather=False, **kw))))
    return out


def _tp(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from f8tensor.export import fp8_state_dict, iter_fp8_weights

    model = _model()
    ref = {fmt: _plain(fp8_state_dict(model, **kw)) for fmt, kw in _FORMATS.items()}
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:  # 256 MLP rows and columns: 128 per rank, whole 128x128 blocks
        plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        parallelize_module(layer.mlp, mesh, plan)
    out = {"ref": ref}
    for fmt, kw in _FORMATS.items():
        out[("gather", fmt)] = _attempt(lambda kw=kw: _plain(fp8_state_dict(model, **kw)))
        out[("local", fmt)] = _attempt(lambda kw=kw: _plain(dict(iter_fp8_weights(model, gather=False, **kw))))
    return out


def _moe(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from f8tensor import Float8LinearConfig, convert_to_float8_training
    from f8tensor.export import fp8_state_dict, iter_fp8_weights

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = Qwen3MoeForCausalLM(cfg)
    recipe = Float8LinearConfig.from_recipe("rowwise")
    convert_to_float8_training(model, config=recipe, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    kw = _FORMATS["channel"]
    ref = _plain(fp8_state_dict(model, **kw))
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model.model.layers[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {
        "ref": {"channel": ref},
        ("gather", "channel"): _attempt(lambda: _plain(fp8_state_dict(model, **kw))),
        ("local", "channel"): _attempt(lambda: _plain(dict(iter_fp8_weights(model, gather=False, **kw)))),
    }


_FORMATS = {"fp8_block": {"format": "fp8_block"}, "channel": {"format": "compressed_tensors", "strategy": "channel"}}
_SCENARIOS = {"fsdp": _fsdp, "tp": _tp, "moe": _moe}


def _worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, WORLD, port)
    result = {name: _attempt(lambda fn=fn: fn(rank)) for name, fn in _SCENARIOS.items()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream")
    run_processes(_worker, WORLD, (free_port(), str(out)), timeout_s=600)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _result(ranks: list, scenario: str, rank: int, key) -> dict:
    res = ranks[rank][scenario]
    assert "error" not in res, res.get("trace")
    got = res[key]
    assert "error" not in got, got.get("trace")
    return got


def _assert_bytes_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert (got[key].dtype, got[key].shape) == (w.dtype, w.shape), key
        assert torch.equal(got[key].view(torch.uint8), w.view(torch.uint8)), key


@pytest.mark.parametrize(
    ("scenario", "fmt"),
    [("fsdp", "fp8_block"), ("fsdp", "channel"), ("tp", "fp8_block"), ("tp", "channel"), ("moe", "channel")],
)
def test_gather_yields_the_one_process_export(ranks, scenario, fmt):
    for rank in range(WORLD):
        ref = ranks[rank][scenario]["ref"][fmt]
        assert any(v.dtype == torch.float8_e4m3fn for v in ref.values())
        _assert_bytes_equal(_result(ranks, scenario, rank, ("gather", fmt)), ref)


def _joined(pieces: list[dict], ref: dict) -> dict:
    """The ranks' pieces put back together along the dimension they differ in from the reference."""
    out = {}
    for key, want in ref.items():
        parts = [p[key] for p in pieces]
        if parts[0].shape == want.shape:
            assert all(torch.equal(p.view(torch.uint8), parts[0].view(torch.uint8)) for p in parts), key
            out[key] = parts[0]
            continue
        dim = next(d for d in range(want.dim()) if parts[0].shape[d] != want.shape[d])
        out[key] = torch.cat(parts, dim=dim)
    return out


@pytest.mark.parametrize(("scenario", "fmt"), [("fsdp", "channel"), ("tp", "fp8_block")])
def test_local_pieces_are_the_export_cut_along_the_shards(ranks, scenario, fmt):
    pieces = [_result(ranks, scenario, rank, ("local", fmt)) for rank in range(WORLD)]
    ref = ranks[0][scenario]["ref"][fmt]
    assert pieces[0]["model.layers.0.mlp.gate_proj.weight"].shape[0] == 128  # a piece, not the whole
    _assert_bytes_equal(_joined(pieces, ref), ref)


@pytest.mark.parametrize(
    ("scenario", "fmt", "key", "cut"),
    [
        # FSDP2 gives each rank 64 of q_proj's 128 rows: half of a 128x128 block.
        ("fsdp", "fp8_block", "model.layers.0.self_attn.q_proj.weight", "[0:64] of a dimension of 128"),
        # Rowwise TP gives each rank 128 of down_proj's 256 columns: half of each row's channel scale.
        ("tp", "channel", "model.layers.0.mlp.down_proj.weight", "[0:128] of a dimension of 256"),
    ],
)
def test_local_pieces_that_cut_a_scale_block_are_refused_by_name(ranks, scenario, fmt, key, cut):
    error = ranks[0][scenario][("local", fmt)]["error"]
    assert error.startswith(f"ValueError: iter_fp8_weights: {key}: this rank holds {cut}"), error
    assert "which cuts a scale block" in error and "pass gather=True" in error


def test_local_pieces_of_experts_split_per_expert_are_refused_by_name(ranks):
    # FSDP2 gives each rank 2 of the 4 experts; the checkpoint names experts 0..3 one by one.
    error = ranks[0]["moe"][("local", "channel")]["error"]
    assert error.startswith(
        "NotImplementedError: iter_fp8_weights: model.layers.0.mlp.experts.gate_up_proj: its checkpoint names"
    ), error
    assert "pass gather=True" in error
