"""The PEFT + transformers side of benches/gpu/run.sh: LoRA training steps on an HF-layout causal
LM folder (make_models.py writes them), timed and measured the way lora-train's metrics.jsonl
reports its own steps, written as one JSON object.

    python peft_side.py --model DIR --batch 4 --seq 2048 --steps 12 --rank 16 \
        --precision bf16 [--checkpointing] [--nf4] [--device cuda] --out peft.json

The step: forward with labels = input_ids (transformers shifts them), loss.backward(),
optimizer.step(), optimizer.zero_grad(set_to_none=True); LoRA r/alpha on every linear layer of the
decoder blocks (q,k,v,o,gate,up,down), dropout 0, torch.optim.AdamW (lr 1e-4, weight decay 0,
PyTorch's default foreach implementation); bf16/fp16: torch.autocast on the frozen bf16/fp16 base
with fp32 adapter weights (fp16 adds torch.amp.GradScaler), fp32: no autocast. Tokens are random
ids below the tokenizer's 256 bytes, the same distribution the bundle's text gives our side.
--nf4: QLoRA's base, `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=<the precision's dtype>)` (bitsandbytes,
CUDA only; the embedding and lm_head stay in the precision's dtype, transformers' default skips),
without prepare_model_for_kbit_training (no fp32 cast of the other weights).
Peaks: torch.cuda.max_memory_allocated / max_memory_reserved, reset after the model and adapter
are on the device (weights included, as lora-train's cuda_peak_bytes); on the CPU: VmHWM.
The first step is a warm-up, left out of the median.
"""

import argparse
import json
import statistics
import time

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def vm_hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--nf4", action="store_true", help="QLoRA base: bitsandbytes NF4 with double quantization (CUDA)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    base_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]
    torch.manual_seed(0)
    if a.nf4:
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=base_dtype,
        )
        # bitsandbytes places the 4-bit weights itself: no .to() after loading
        model = AutoModelForCausalLM.from_pretrained(
            a.model, dtype=base_dtype, attn_implementation="sdpa", quantization_config=quant, device_map={"": dev}
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=base_dtype, attn_implementation="sdpa").to(dev)
    if a.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.config.use_cache = False
    cfg = LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    for n, prm in model.named_parameters():
        if prm.requires_grad:
            prm.data = prm.data.float()
    trainable = [prm for prm in model.parameters() if prm.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    scaler = torch.amp.GradScaler(dev.type) if a.precision == "fp16" else None
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (a.batch, a.seq), generator=g) for _ in range(a.steps)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for ids in batches:
        ids = ids.to(dev)
        t = time.perf_counter()
        with torch.autocast(dev.type, dtype=base_dtype, enabled=a.precision != "fp32"):
            loss = model(input_ids=ids, labels=ids).loss
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    timed = times[1:] or times
    med = statistics.median(timed)
    out = {
        "side": "peft",
        "median_step_s": med,
        "tokens_per_s": a.batch * a.seq / med,
        "steps": len(times),
        "step_times_s": times,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "trainable_params": sum(prm.numel() for prm in trainable),
        "torch": torch.__version__,
    }
    if cuda:
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:
        out["peak_rss_bytes"] = vm_hwm()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
