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
  4. the adapters saved by PEFT, and the base saved again in the same format: the file's bytes;
  5. weight sync: a trained policy's FP8 tensors in memory (the file's, bit for bit), handed to
     a running vLLM engine where vLLM is installed (skipped otherwise).
"""

import importlib.util
import os
import tempfile
import warnings

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from f8tensor import Float8LinearConfig, convert_to_float8_training
from f8tensor.export import fp8_state_dict, iter_fp8_weights, load_fp8_pretrained, save_fp8_pretrained

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

# 5. Weight sync to a rollout engine. RL trains a policy and hands its weights to an FP8 engine
#    after each few steps; iter_fp8_weights yields the tensors save_fp8_pretrained writes, one
#    layer at a time, in the checkpoint's names, so the engine serves the bytes training
#    multiplied. Here the policy trains its weights (frozen=False: bf16 masters, FP8 rowwise
#    casts) and the engine reads compressed-tensors channel FP8 (what vLLM's CPU build serves).
with torch.device("meta"):
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
load_fp8_pretrained(policy, checkpoint, config=Float8LinearConfig.from_recipe("rowwise"), frozen=False)
opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)


def train(steps: int) -> None:
    for _ in range(steps):
        policy(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


export = {"format": "compressed_tensors", "strategy": "channel"}
train(2)
engine_dir = os.path.join(out, "engine")
save_fp8_pretrained(policy, engine_dir, **export)
in_memory = fp8_state_dict(policy, **export)
on_disk = load_file(os.path.join(engine_dir, "model.safetensors"))
assert in_memory.keys() == on_disk.keys()
assert all(torch.equal(in_memory[k].contiguous().view(torch.uint8), v.view(torch.uint8)) for k, v in on_disk.items())
print(f"in memory: the {len(on_disk)} tensors of the file, bit for bit")

if importlib.util.find_spec("vllm") is None:
    print("vLLM is not installed: the engine sync is skipped")
else:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process takes the generator
    from vllm import LLM, SamplingParams

    llm = LLM(model=engine_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64, enforce_eager=True)
    params = SamplingParams(max_tokens=1, temperature=0, detokenize=False, prompt_logprobs=1)
    prompt = [{"prompt_token_ids": ids[0, :16].tolist()}]

    def prompt_logprobs() -> list[float]:
        out_ = llm.generate(prompt, params)[0]
        return [d[t].logprob for d, t in zip(out_.prompt_logprobs[1:], prompt[0]["prompt_token_ids"][1:], strict=True)]

    served = prompt_logprobs()
    train(3)
    # vLLM's reload path: its FP8 layers take the new bytes and redo their post-load processing.
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter_fp8_weights(policy, **export)})
    synced = prompt_logprobs()
    print(f"engine synced: mean prompt logprob {sum(served) / len(served):.3f} -> {sum(synced) / len(synced):.3f}")
