"""The parts of benches/gpu/run.sh (which starts this with the python that has torch). Each part
records "ok", "skipped" (with the missing prerequisite) or "failed" (with the error), and the
run goes on; results.json and results.md are rewritten after every part, so a run cut short
keeps what it measured.

Parts:
  1 sanity      CUDA device name, capability, free memory, a bf16 matmul against fp32
                (--cpu: the CPU bf16 matmul);
  2 llm         our trainer (the bundle's `lora-train train`) vs PEFT + transformers
                (peft_side.py) on the same random-init Llama-3.2-1B-shaped folder
                (make_models.py), LoRA r16 alpha 32 on all linear layers, bf16 autocast, AdamW,
                batch x seq 4 x 2048 and 1 x 8192: median step time, tokens/s, peak allocated and
                reserved memory on each side, and the planner's prediction beside our peak;
  3 variants    the 4 x 2048 case with gradient checkpointing, and with fp16 + loss scaling;
  3b nf4        the 4 x 2048 bf16 case on an NF4 (QLoRA) base: ours with `model.weights:
                quantized` on the same random-init folder (NF4 double-quant layer linears, the
                embedding and head dense f32, computing under bf16 autocast); PEFT with
                BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16) when bitsandbytes
                imports and CUDA is present, else that side is skipped with the reason;
  4 oom         skipped: the CLI has no CUDA memory-fraction setting to force an OOM with;
  5 unet        skipped: our SD job needs a whole pipeline folder (VAE, text encoders,
                tokenizers); make_models.py writes the UNet alone;
  6 plan        folded into 2 and 3: every measured peak of ours sits beside its prediction.
--cpu: part 1 on the CPU, parts 2-3b with the tiny Llama shape, batch x seq 2 x 64, fp32
(bf16 autocast for the bf16 case), 4 steps; 3b's PEFT side is skipped (bitsandbytes' 4-bit
layers need CUDA).
"""

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Results:
    def __init__(self, out, meta):
        self.out = out
        self.doc = {"meta": meta, "parts": {}}

    def record(self, part, status, **fields):
        self.doc["parts"][part] = dict(status=status, **fields)
        self.write()

    def write(self):
        with open(os.path.join(self.out, "results.json"), "w") as f:
            json.dump(self.doc, f, indent=1)
        with open(os.path.join(self.out, "results.md"), "w") as f:
            f.write(markdown(self.doc))


def gib(b):
    if b is None:
        return "—"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def pct(a, b):
    return "—" if a is None or b is None or b == 0 else f"{100.0 * (a - b) / b:+.1f}%"


def markdown(doc):
    m = doc["meta"]
    lines = [
        "# GPU comparison: lora-train vs PEFT + transformers",
        "",
        f"{m.get('when')} on {m.get('device')}; bundle built for PyTorch {m.get('bundle_pytorch')}, "
        f"python torch {m.get('python_torch')}; mode {m.get('mode')}.",
        "",
    ]
    if m.get("mode", "").startswith("cpu"):
        lines += [
            "A --cpu run checks the chain (bundle, launcher, models, both sides, the report) on toy shapes; "
            "its times are no benchmark. On the CPU, our peak allocated is the counting allocator's tensor peak "
            "and PEFT has none; peak RSS is each process's VmHWM.",
            "",
        ]
    for name, p in doc["parts"].items():
        lines.append(f"## {name}: {p['status']}")
        if p.get("reason"):
            lines.append("")
            lines.append(p["reason"])
        if p.get("error"):
            lines.append("")
            lines.append("```\n" + p["error"][-2000:] + "\n```")
        if p.get("facts"):
            lines.append("")
            for k, v in p["facts"].items():
                lines.append(f"- {k}: {v}")
        if p.get("cases"):
            lines += [
                "",
                "| case | side | median step | tokens/s | peak allocated | peak reserved | peak RSS | planned allocated | plan error | ours/PEFT step time |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            for c in p["cases"]:
                o, q = c.get("ours") or {}, c.get("peft") or {}
                ratio = (
                    f"{o['median_step_s'] / q['median_step_s']:.2f}"
                    if o.get("median_step_s") and q.get("median_step_s")
                    else "—"
                )
                for side, r in (("ours", o), ("peft", q)):
                    if not r:
                        continue
                    if r.get("status") and r["status"] != "ok":
                        why = " ".join(r.get("reason", r.get("error", "")).replace("|", "/").split())[-160:]
                        lines.append(f"| {c['case']} | {side} | {r['status']}: {why} | | | | | | | |")
                        continue
                    lines.append(
                        f"| {c['case']} | {side} | {r['median_step_s'] * 1000:.1f} ms | {r['tokens_per_s']:.0f} | "
                        f"{gib(r.get('peak_allocated_bytes'))} | {gib(r.get('peak_reserved_bytes'))} | {gib(r.get('peak_rss_bytes'))} | "
                        f"{gib(r.get('planned_allocated_bytes'))} | "
                        f"{pct(r.get('peak_allocated_bytes'), r.get('planned_allocated_bytes'))} | {ratio if side == 'ours' else ''} |"
                    )
        lines.append("")
    lines.append(
        "Goals: our peak allocated within ±3% of the plan; step time ours/PEFT ≤ 0.7. The random-init "
        "weights change neither time nor memory (make_models.py says where they would matter)."
    )
    return "\n".join(lines) + "\n"


def run(cmd, timeout, env=None, cwd=None):
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    return r, time.perf_counter() - t


def part_sanity(res, a):
    import torch

    if a.cpu:
        x = torch.randn(256, 256)
        ref = x @ x
        got = (x.bfloat16() @ x.bfloat16()).float()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        res.record("1 sanity", "ok" if err < 2e-2 else "failed", facts={
            "device": "cpu", "threads": torch.get_num_threads(),
            "bf16 matmul max error / max |ref| (256x256)": f"{err:.2e}",
        })
        return
    if not torch.cuda.is_available():
        res.record("1 sanity", "skipped", reason=f"no CUDA device visible to torch {torch.__version__} (CUDA {torch.version.cuda})")
        return
    free, total = torch.cuda.mem_get_info(0)
    x = torch.randn(4096, 4096, device="cuda")
    ref = x @ x
    got = (x.bfloat16() @ x.bfloat16()).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    res.record("1 sanity", "ok" if err < 2e-2 else "failed", facts={
        "device": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "free / total": f"{gib(free)} / {gib(total)}",
        "torch / CUDA": f"{torch.__version__} / {torch.version.cuda}",
        "bf16 matmul max error / max |ref| (4096x4096)": f"{err:.2e}",
    })


def text_file(path, n_bytes, seed=0):
    """Random lowercase words: ~1 token per byte under make_models' byte tokenizer."""
    rng = random.Random(seed)
    words = []
    size = 0
    while size < n_bytes:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        words.append(w)
        size += len(w) + 1
    with open(path, "w") as f:
        f.write(" ".join(words))


def ours_config(path, model, text, out_dir, case, device):
    prec = case["precision"]
    # a base kept quantized computes in f32 whatever model.dtype says (its embedding, norms and
    # head held in f32): say so, so the plan counts what is loaded; autocast still applies
    nf4 = case.get("nf4", False)
    lines = [
        "model:",
        f"  base_model: {model}",
        f"  dtype: {'f32' if prec == 'fp32' or nf4 else ('f16' if prec == 'fp16' else 'bf16')}",
    ] + (["  weights: quantized"] if nf4 else []) + [
        "lora:",
        f"  rank: {case['rank']}",
        f"  alpha: {2 * case['rank']}",
        f"  target_modules: [{', '.join(TARGETS)}]",
        "data:",
        f"  train_data_dir: {text}",
        "  format: text",
        f"  seq_len: {case['seq']}",
        "  eval_fraction: 0.0",
        "train:",
        f"  batch_size: {case['batch']}",
        f"  max_steps: {case['steps']}",
        "  learning_rate: 1.0e-4",
        "  optimizer: AdamW",
        "  weight_decay: 0.0",
        "  mixed_precision: " + ('"no"' if prec == "fp32" else prec),
        f"  gradient_checkpointing: {'true' if case['checkpointing'] else 'false'}",
        f"  output_dir: {out_dir}",
        "  output_name: adapter",
        "  export_formats: [peft]",
        "memory:",
        ("  gpu: local" if device == "cuda" else "  budget: 64GB"),
        "logging:",
        "  log_every_n_steps: 1",
        "  progress: false",
        "system:",
        "  seed: 0",
        f"  device: {device}",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def ours_side(a, model, text, work, case, device):
    out_dir = os.path.join(work, "ours-" + case["case"])
    shutil.rmtree(out_dir, ignore_errors=True)
    cfg = os.path.join(work, f"ours-{case['case']}.yaml")
    ours_config(cfg, model, text, out_dir, case, device)
    r, wall = run([a.launcher, "train", "--config", cfg, "--force"], timeout=a.part_timeout)
    if r.returncode != 0:
        return {"status": "failed", "error": (r.stdout + r.stderr)[-3000:]}
    steps = []
    with open(os.path.join(out_dir, "logs", "metrics.jsonl")) as f:
        for line in f:
            o = json.loads(line)
            if o.get("type") == "step":
                steps.append(o)
    summary = json.load(open(os.path.join(out_dir, "summary.json")))
    times = [s["step_time_s"] for s in steps]
    timed = times[1:] or times
    med = statistics.median(timed)
    tokens = statistics.median([s["tokens"] for s in steps[1:] or steps])
    mem = steps[-1]["mem"]
    est = summary["plan"]["estimate"]
    o = {
        "status": "ok",
        "median_step_s": med,
        "tokens_per_s": tokens / med,
        "steps": len(steps),
        "step_times_s": times,
        "first_loss": steps[0]["loss"],
        "last_loss": steps[-1]["loss"],
        "wall_s": wall,
        "planned_allocated_bytes": est["peak_allocated"],
        "planned_reserved_bytes": est["peak_reserved"],
    }
    if device == "cuda":
        o["peak_allocated_bytes"] = mem.get("cuda_peak_bytes")
        o["peak_reserved_bytes"] = None  # the CLI's metrics carry the allocated peak only
    else:
        o["peak_allocated_bytes"] = summary["memory"]["tensor_peak"]
        o["peak_rss_bytes"] = summary["memory"]["rss_peak_process"]
    return o


def peft_side(a, model, case, device, work):
    out = os.path.join(work, f"peft-{case['case']}.json")
    cmd = [sys.executable, os.path.join(HERE, "peft_side.py"), "--model", model,
           "--batch", str(case["batch"]), "--seq", str(case["seq"]), "--steps", str(case["steps"]),
           "--rank", str(case["rank"]), "--alpha", str(2 * case["rank"]),
           "--precision", case["precision"], "--device", device, "--out", out]
    if case["checkpointing"]:
        cmd.append("--checkpointing")
    if case.get("nf4"):
        cmd.append("--nf4")
    r, wall = run(cmd, timeout=a.part_timeout)
    if r.returncode != 0:
        return {"status": "failed", "error": (r.stdout + r.stderr)[-3000:]}
    o = json.load(open(out))
    o["status"] = "ok"
    o["wall_s"] = wall
    return o


def have(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


def nf4_peft_skip(device):
    """Why PEFT's NF4 side cannot run here (None when it can): bitsandbytes' 4-bit layers need
    the package and a CUDA device."""
    if device != "cuda":
        return "bitsandbytes' NF4 layers (Linear4bit) run on CUDA only; this run is on the CPU"
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:  # an ImportError, or a broken CUDA setup raising at import
        return f"bitsandbytes does not import in this python ({type(e).__name__}: {e})"
    return None


def part_llm(res, a, name, cases, model, device, work, peft_skip=None):
    text = os.path.join(work, "text.txt")
    need = max(c["batch"] * c["seq"] * (c["steps"] + 2) for c in cases)
    text_file(text, int(need * 1.2))
    peft_ok = have("peft") and have("transformers")
    done = []
    for c in cases:
        row = {"case": c["case"], "settings": c}
        row["ours"] = ours_side(a, model, text, work, c, device)
        if not peft_ok:
            row["peft"] = {"status": "skipped", "reason": "peft or transformers not installed in this python"}
        elif peft_skip:
            row["peft"] = {"status": "skipped", "reason": peft_skip}
        else:
            row["peft"] = peft_side(a, model, c, device, work)
        done.append(row)
        status = "ok" if all(r["ours"]["status"] == "ok" for r in done) else "failed"
        res.record(name, status, cases=done)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--models", help="folder for make_models.py (default OUT/models)")
    p.add_argument("--part-timeout", type=int, default=240)
    a = p.parse_args()
    a.launcher = os.path.join(os.path.abspath(a.bundle), "lora-train")
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join(os.path.abspath(a.out), "work")
    os.makedirs(work, exist_ok=True)
    models = a.models or os.path.join(os.path.abspath(a.out), "models")

    import torch

    bundle = json.load(open(os.path.join(a.bundle, "bundle.json")))
    cuda = torch.cuda.is_available() and not a.cpu
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "mode": "cpu (small shapes)" if a.cpu else "gpu",
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)",
        "bundle_pytorch": bundle.get("built_for_pytorch"),
        "bundle_commit": bundle.get("git_commit"),
        "python_torch": torch.__version__,
        "load_avg": open("/proc/loadavg").read().split()[:3],
    }
    r, _ = run([a.launcher, "doctor", "--json"], timeout=120)
    if r.returncode == 0:
        meta["doctor"] = json.loads(r.stdout)["libtorch"]
    else:
        meta["doctor_error"] = (r.stdout + r.stderr)[-2000:]
    res = Results(a.out, meta)
    if r.returncode != 0:
        res.record("0 bundle", "failed", error=meta["doctor_error"])
        return 1

    part_sanity(res, a)

    if a.cpu:
        model_name, device = "tiny-llama", "cpu"
        base = dict(batch=2, seq=64, steps=4, rank=16, checkpointing=False)
        main_cases = [dict(base, case="2x64-fp32", precision="fp32"), dict(base, case="2x64-bf16", precision="bf16")]
        variants = [dict(base, case="2x64-fp32-ckpt", precision="fp32", checkpointing=True)]
        nf4_cases = [dict(base, case="2x64-fp32-nf4", precision="fp32", nf4=True)]
    elif cuda:
        model_name, device = "llama-3.2-1b", "cuda"
        main_cases = [
            dict(case="4x2048-bf16", batch=4, seq=2048, steps=12, rank=16, precision="bf16", checkpointing=False),
            dict(case="1x8192-bf16", batch=1, seq=8192, steps=12, rank=16, precision="bf16", checkpointing=False),
        ]
        variants = [
            dict(case="4x2048-bf16-ckpt", batch=4, seq=2048, steps=12, rank=16, precision="bf16", checkpointing=True),
            dict(case="4x2048-fp16", batch=4, seq=2048, steps=12, rank=16, precision="fp16", checkpointing=False),
        ]
        nf4_cases = [
            dict(case="4x2048-bf16-nf4", batch=4, seq=2048, steps=12, rank=16, precision="bf16", checkpointing=False, nf4=True),
        ]
    else:
        for part in ("2 llm", "3 variants", "3b nf4", "4 oom", "5 unet"):
            res.record(part, "skipped", reason="no CUDA device (run with --cpu for the small CPU shapes)")
        return 0

    if not (have("transformers") and have("safetensors") and have("tokenizers")):
        for part in ("2 llm", "3 variants", "3b nf4"):
            res.record(part, "skipped", reason="make_models.py needs transformers, safetensors and tokenizers in this python")
    else:
        r, _ = run([sys.executable, os.path.join(HERE, "make_models.py"), models, model_name], timeout=900)
        if r.returncode != 0:
            res.record("2 llm", "failed", error=(r.stdout + r.stderr)[-3000:])
        else:
            model = os.path.join(models, model_name)
            part_llm(res, a, "2 llm", main_cases, model, device, work)
            part_llm(res, a, "3 variants", variants, model, device, work)
            part_llm(res, a, "3b nf4", nf4_cases, model, device, work, peft_skip=nf4_peft_skip(device))
    res.record("4 oom", "skipped", reason="the CLI has no CUDA memory-fraction setting to force an out-of-memory step with")
    res.record("5 unet", "skipped", reason="our SD job trains from a whole pipeline folder (VAE, text encoders, tokenizers); make_models.py writes UNets only")
    failed = [k for k, v in res.doc["parts"].items() if v["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
