"""The Python side of `cargo xtask bench-compare`: the same LoRA training job through PEFT +
transformers, as a plain PyTorch loop (forward, loss, backward, optimizer.step, zero_grad).

Reads the job folder written by `bench-train prepare`:
- `batches.safetensors`: `input_ids` [steps, batch, seq_len] int64 (labels = input_ids; the model
  shifts them inside);
- `adapter_init/`: the initial LoRA A/B as a PEFT adapter, loaded with
  `PeftModel.from_pretrained(..., is_trainable=True)`.

The base is SmolLM2-135M-Instruct from the GGUF file, dequantized by transformers
(`from_pretrained(folder, gguf_file=..., dtype=torch.float32)`). Writes the same JSON fields as
lora_benches::job::TrainResult.

    python benches/python/peft_train.py --model assets/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --job JOB_DIR --steps 6 --threads 2 --out peft.json [--device cuda --precision bf16]
        [--phases] [--profile DIR]

`--phases` also times forward, backward and optimizer separately (synchronizing between them).
`--profile DIR` records every step after the first with `torch.profiler` and writes
`DIR/ops_peft.json` (per operator, from `key_averages()`: calls, self and total CPU seconds per
step; the fields of lora_benches::job::OpsFile) and `DIR/trace_peft.json` (Chrome trace).
"""

import argparse
import json
import os
import time


def rss():
    """(VmRSS, VmHWM) of this process in bytes, from /proc/self/status."""
    out = {"VmRSS:": 0, "VmHWM:": 0}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(" ", 1)[0].split("\t", 1)[0]
            if k in out:
                out[k] = int(line.split()[1]) * 1024
    return out["VmRSS:"], out["VmHWM:"]


def reset_peak_rss():
    """Resets VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def write_ops(prof, out_dir, steps):
    """`ops_peft.json` (per operator and step: calls, self and total CPU seconds) and
    `trace_peft.json` from a finished `torch.profiler.profile`."""
    os.makedirs(out_dir, exist_ok=True)
    n = max(1, steps)

    def entries(averages, shapes):
        out = [
            {
                "name": e.key,
                "shapes": ", ".join(
                    "[" + ", ".join(str(d) for d in s) + "]" for s in e.input_shapes
                )
                if shapes
                else "",
                "calls_per_step": e.count / n,
                "self_s": e.self_cpu_time_total / 1e6 / n,
                "total_s": e.cpu_time_total / 1e6 / n,
            }
            for e in averages
        ]
        out.sort(key=lambda o: -o["self_s"])
        return out

    ops = entries(prof.key_averages(), False)
    by_shapes = entries(prof.key_averages(group_by_input_shape=True), True)[:40]
    with open(os.path.join(out_dir, "ops_peft.json"), "w") as f:
        json.dump(
            {"side": "peft", "steps": steps, "ops": ops, "by_shapes": by_shapes}, f, indent=1
        )
    prof.export_chrome_trace(os.path.join(out_dir, "trace_peft.json"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--phases", action="store_true")
    p.add_argument("--profile", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(a.threads)
    dev = torch.device("cuda:0" if a.device == "cuda" else "cpu")

    t0 = time.perf_counter()
    model_path = os.path.abspath(a.model)
    base = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path),
        gguf_file=os.path.basename(model_path),
        dtype=torch.float32,
    ).to(dev)
    model = PeftModel.from_pretrained(
        base, os.path.join(a.job, "adapter_init"), is_trainable=True
    )
    model.train()
    load_s = time.perf_counter() - t0

    ids = load_file(os.path.join(a.job, "batches.safetensors"))["input_ids"]
    if a.steps > ids.shape[0]:
        raise SystemExit(f"{a.steps} steps asked, the job holds {ids.shape[0]} batches")
    ids = ids.to(dev)
    b, s = ids.shape[1], ids.shape[2]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    autocast = (
        torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
        if a.precision == "bf16"
        else torch.autocast(device_type=dev.type, enabled=False)
    )
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    baseline, _ = rss()
    reset_peak_rss()
    times, cpu, losses = [], [], []
    phases = {"forward": [], "backward": [], "optimizer": []}
    prof = None
    for i in range(a.steps):
        batch = ids[i]
        sync()
        if i == 1 and a.profile:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if dev.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=acts, record_shapes=True)
            prof.__enter__()
        c0 = time.process_time()
        t = time.perf_counter()
        with autocast:
            out = model(input_ids=batch, labels=batch)
        loss = out.loss
        if a.phases:
            sync()
            tf = time.perf_counter()
        loss.backward()
        if a.phases:
            sync()
            tb = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.item()
        sync()
        te = time.perf_counter()
        times.append(te - t)
        cpu.append(time.process_time() - c0)
        losses.append(lv)
        if a.phases:
            phases["forward"].append(tf - t)
            phases["backward"].append(tb - tf)
            phases["optimizer"].append(te - tb)
        del out, loss
    if prof is not None:
        prof.__exit__(None, None, None)
        write_ops(prof, a.profile, a.steps - 1)
    _, hwm = rss()
    result = {
        "side": "peft",
        "device": a.device,
        "precision": a.precision,
        "threads": a.threads,
        "batch": int(b),
        "seq_len": int(s),
        "load_s": load_s,
        "step_times_s": times,
        "step_cpu_s": cpu,
        "losses": losses,
        "tokens_per_step": int(b * s),
        "rss_baseline_bytes": baseline,
        "rss_peak_bytes": hwm,
        "rss_delta_bytes": max(0, hwm - baseline),
        "tensor_peak_bytes": None,
        "cuda_peak_bytes": int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None,
        "phases_s": {
            k: sum(v[1:]) / max(1, len(v) - 1) for k, v in phases.items() if a.phases and v
        },
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
