"""Measures the CUDA allocator peaks of PEFT + transformers LoRA training for the runs listed in
mem_configs.json (each run in its own process, so the peak counts everything from the start).

    python benches/gpu/mem_check.py OUT.json           # all runs
    python benches/gpu/mem_check.py --one ID OUT.json   # one run (used by the above)

Peaks are reset after the model is built, so they are the training peaks (weights included,
as they stay allocated). The predictions to compare with come from `cargo run -p lora-memory --example gpu_check -- OUT.json`.
"""
import json, os, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))


def one(run_id, out_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig, get_peft_model

    spec = json.load(open(os.path.join(HERE, "mem_configs.json")))
    run = next(r for r in spec["runs"] if r["id"] == run_id)
    cfg = LlamaConfig(**spec["models"][run["model"]])
    cfg._attn_implementation = "sdpa"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[run["dtype"]]
    torch.manual_seed(0)
    dev = torch.device("cuda")
    torch.set_default_dtype(dtype)  # build the weights in their dtype: no fp32 copy at load
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.config.use_cache = False
    if run["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    b, s = run["batch"], run["seq"]
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=dev)
    torch.cuda.synchronize()
    load_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()  # training peak; the weights stay counted (allocated)
    t0 = time.time()
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    res = dict(run, max_allocated=torch.cuda.max_memory_allocated(),
               max_reserved=torch.cuda.max_memory_reserved(),
               load_peak=load_peak, seconds=time.time() - t0, loss=float(loss),
               torch=torch.__version__, gpu=torch.cuda.get_device_name(0))
    json.dump(res, open(out_path, "w"))


def main():
    if sys.argv[1] == "--one":
        return one(sys.argv[2], sys.argv[3])
    out = sys.argv[1]
    spec = json.load(open(os.path.join(HERE, "mem_configs.json")))
    results = []
    try:
        import transformers, peft  # noqa: F401
        versions = {"transformers": transformers.__version__, "peft": peft.__version__}
    except Exception as e:  # report what is missing and stop
        json.dump({"error": f"missing python packages: {e}"}, open(out, "w"))
        print("missing:", e)
        return
    for r in spec["runs"]:
        tmp = out + f".{r['id']}.json"
        p = subprocess.run([sys.executable, __file__, "--one", r["id"], tmp],
                           capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            results.append(dict(r, error=p.stderr[-2000:]))
        else:
            results.append(json.load(open(tmp)))
        print(json.dumps(results[-1])[:300], flush=True)
    json.dump({"versions": versions, "results": results}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
