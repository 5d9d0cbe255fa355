"""Tutorial 14: train in FP8, serve the same bytes: export a checkpoint that inference engines load.

    python tutorials/14_export_for_inference.py      # CPU, a few seconds

A model trained with f8tensor keeps bf16 (or fp32) weights. Inference engines (vLLM, SGLang,
transformers) read FP8 checkpoints in two formats: the DeepSeek-V3 block format
(``quant_method: "fp8"``, 128x128 weight blocks; or its MXFP8 variant) and compressed-tensors
``float-quantized``. ``save_fp8_pretrained`` writes either, with f8tensor's own casts: where the
format matches the training recipe (here blockwise -> ``fp8_block``) the stored bytes are the
ones the training forward multiplied, so nothing is re-quantized by another tool.

What you will see:
  1. a tiny Qwen3-MoE model converted with the blockwise recipe and trained a few steps;
  2. exported in the three formats, each file listed (FP8 weights, their scales, and the
     high-precision modules the config names: lm_head, embeddings, norms, router);
  3. each export loaded back with ``AutoModelForCausalLM.from_pretrained`` (on a CPU the loader
     dequantizes): its logits equal, bit for bit, those of the trained model with every FP8
     weight replaced by its dequantized cast;
  4. the other direction: the loaded FP8 checkpoint converted again and fine-tuned.
"""

import json
import os
import tempfile

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from f8tensor import (
    BLOCK_128x128,
    Float8ExpertWeight,
    Float8Linear,
    Float8LinearConfig,
    Float8Tensor,
    convert_to_float8_training,
    sqnr,
)
from f8tensor.export import save_fp8_pretrained

torch.set_num_threads(1)
torch.manual_seed(0)

# ----------------------------------------------------------------------------- 1. train in FP8
config = Qwen3MoeConfig(
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
model = Qwen3MoeForCausalLM(config)  # fp32 master weights: the export casts these
recipe = Float8LinearConfig.from_recipe("blockwise")  # 128x128 weight blocks, as fp8_block stores them
convert_to_float8_training(model, config=recipe, module_filter_fn=lambda m, fqn: fqn != "lm_head")
ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"1. step {step}: loss {loss.item():.3f}")


# ----------------------------------------------------------------------------- reference
def dequantized_twin(model):
    """The trained model with each FP8 weight replaced by what a loader computes from the file:
    the cast's bytes times the fp32 reciprocal of its scale (f8tensor's scale maps hp -> FP8)."""

    def deq(w):
        t = Float8Tensor.from_hp(w, granularity=BLOCK_128x128)
        inv = torch.reciprocal(t._scale).repeat_interleave(128, 0).repeat_interleave(128, 1)
        return (t._data.float() * inv).to(w.dtype)

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for fqn, mod in model.named_modules():
        if isinstance(mod, Float8Linear):
            state[f"{fqn}.weight"] = deq(mod.weight.detach())
        for name, p in mod.named_parameters(recurse=False):
            if isinstance(p, Float8ExpertWeight):
                state[f"{fqn}.{name}"] = torch.stack([deq(w) for w in p._hp.detach()])
    twin = Qwen3MoeForCausalLM(config)
    twin.load_state_dict(state)
    return twin.eval()


twin = dequantized_twin(model)
with torch.no_grad():
    want = twin(ids).logits

# ----------------------------------------------------------------------------- 2-3. export, reload
with tempfile.TemporaryDirectory() as tmp:
    for fmt in ("fp8_block", "mxfp8", "compressed_tensors"):
        out = os.path.join(tmp, fmt)
        save_fp8_pretrained(model, out, format=fmt)  # compressed-tensors: strategy "block", from the recipe
        with open(os.path.join(out, "config.json")) as f:
            qc = json.load(f)["quantization_config"]
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            keys = list(f.keys())
            shown = [k for k in keys if ".experts.0.gate_proj" in k or ".q_proj" in k]
            print(f"2. {fmt}: {len(keys)} tensors, e.g.")
            for k in shown:
                sl = f.get_slice(k)
                print(f"     {k}: {sl.get_dtype()} {sl.get_shape()}")
            dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
        skipped = qc.get("modules_to_not_convert", qc.get("ignore"))
        print(f"   quant_method {qc['quant_method']!r}, kept in high precision: {skipped}")
        # The FP8 weights as FP8 bytes; lm_head, the embeddings, the norms and the router named
        # as kept in high precision, and stored so.
        assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
        assert dtypes["model.layers.0.mlp.experts.0.gate_proj.weight"] == "F8_E4M3"
        kept = {
            "lm_head",
            "model.embed_tokens",
            "model.norm",
            "model.layers.0.mlp.gate",
            "model.layers.0.input_layernorm",
        }
        assert kept <= set(skipped) and dtypes["lm_head.weight"] == dtypes["model.layers.0.mlp.gate.weight"] == "F32"
        kwargs = (
            {"quantization_config": CompressedTensorsConfig(dequantize=True)} if fmt == "compressed_tensors" else {}
        )
        loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, **kwargs)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        with torch.no_grad():
            got = loaded(ids).logits
        if fmt != "mxfp8":  # mxfp8 stores other (1x32) scales than the 128x128 twin
            assert torch.equal(got, want)
            print("3.   reloaded: logits equal the dequantized twin's bit for bit")
        else:
            print(f"3.   reloaded: max |logit difference| vs the 128x128 twin {(got - want).abs().max():.4f}")
            # Two FP8 casts of the same weights, 1x32 and 128x128 blocks: measured 27.9 dB apart.
            assert sqnr(want, got) >= 25.0, f"mxfp8 export: {sqnr(want, got):.1f} dB from the 128x128 twin"

        # ------------------------------------------------------------------------- 4. fine-tune it again
        if fmt == "fp8_block":
            loaded.config.quantization_config = None  # the weights are plain now: train them in FP8 again
            convert_to_float8_training(loaded, config=recipe, module_filter_fn=lambda m, fqn: fqn != "lm_head")
            opt = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
            for _ in range(2):
                loss = loaded(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
            assert torch.isfinite(loss)
            print(f"4. the FP8 checkpoint, converted again, fine-tunes: loss {loss.item():.3f}")
