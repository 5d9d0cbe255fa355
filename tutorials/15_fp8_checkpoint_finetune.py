"""Tutorial 15: fine-tune an FP8 checkpoint with LoRA in FP8, its weights kept as the file's bytes.

    python tutorials/15_fp8_checkpoint_finetune.py      # CPU, a few seconds

FP8 releases (DeepSeek-V3, Qwen3-FP8, ...) store each linear weight in e4m3 with a scale.
Loaded through transformers on a machine without an FP8 kernel they come in dequantized to
bf16: 2 bytes per weight, and bytes that differ from the file's once cast to FP8 again.
``load_fp8_pretrained`` keeps them as the file's FP8 bytes, frozen, and the forward multiplies
exactly those bytes; adapters (PEFT LoRA) train on top, their gradients reaching the inputs.

What you will see:
  1. an FP8 checkpoint in the DeepSeek-V3 block format (written here by f8tensor; one written by
     another tool loads the same way);
  2. a model built on the meta device and loaded from it: each linear holds the file's bytes,
     about 1 byte per weight element, and refuses to train;
  3. LoRA on the frozen FP8 base: the loss goes down, the base bytes stay the file's;
  4. the adapters saved by PEFT, and the base saved again in the same format: the file's bytes.
"""

import os
import tempfile
import warnings

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from f8tensor import Float8LinearConfig, convert_to_float8_training
from f8tensor.export import load_fp8_pretrained, save_fp8_pretrained

warnings.filterwarnings("ignore", message=".*no cpu kernel.*")  # CPU: FP8 products are emulated
torch.manual_seed(0)
out = os.environ.get("F8TENSOR_OUT") or tempfile.mkdtemp()
config = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
)

# 1. An FP8 checkpoint: a bf16 model converted with the DeepSeek-V3 (blockwise) recipe, exported.
source = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
convert_to_float8_training(
    source, config=Float8LinearConfig.from_recipe("blockwise"), module_filter_fn=lambda m, fqn: fqn != "lm_head"
)
checkpoint = os.path.join(out, "fp8_checkpoint")
save_fp8_pretrained(source, checkpoint, format="fp8_block")
file = load_file(os.path.join(checkpoint, "model.safetensors"))
print("checkpoint:", sum(v.dtype == torch.float8_e4m3fn for v in file.values()), "FP8 weights")

# 2. Load it into a model built on the meta device: no bf16 copy of the FP8 weights is ever made.
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
load_fp8_pretrained(model, checkpoint)  # frozen=True; the recipe defaults to the checkpoint's (blockwise)
up = model.model.layers[0].mlp.up_proj
print(up)
assert torch.equal(up.weight._data.view(torch.uint8), file["model.layers.0.mlp.up_proj.weight"].view(torch.uint8))
held = sum(t.numel() * t.element_size() for t in (up.weight._data, up.weight._scale, up.checkpoint_scale))
print(f"up_proj holds {held / up.weight.numel():.4f} bytes per weight element (bf16: 2)")
try:
    up.weight.requires_grad_(True)
except RuntimeError as e:
    print("requires_grad_(True) refused:", str(e)[:80], "...")

# 3. LoRA on the frozen FP8 base.
lora = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]))
lora.print_trainable_parameters()
opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
ids = torch.randint(0, 256, (4, 32))
before = up.weight._data.clone()
for step in range(10):
    loss = lora(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step in (0, 9):
        print(f"LoRA step {step}: loss {loss.item():.3f}")
assert torch.equal(up.weight._data.view(torch.uint8), before.view(torch.uint8)), "the base bytes never change"

# 4. The adapters saved on their own (PEFT); the base, unwrapped, saved again in the same format.
lora.save_pretrained(os.path.join(out, "adapters"))
base = lora.unload()  # the FP8 layers without the adapters (a merge would change the FP8 bytes)
again = os.path.join(out, "fp8_again")
save_fp8_pretrained(base, again, format="fp8_block")
same = all(
    torch.equal(v.view(torch.uint8), file[k].view(torch.uint8))
    for k, v in load_file(os.path.join(again, "model.safetensors")).items()
    if v.dtype == torch.float8_e4m3fn
)
print("saved again: FP8 weight bytes equal the file's:", same)
assert same

# ---------------------------------------------------------------------------------------------
# 5. Weight sync to a rollout engine (vLLM): added with f8tensor.export.iter_fp8_weights.
#    Placeholder kept for that part; it is skipped where vLLM is not installed.
# ---------------------------------------------------------------------------------------------
