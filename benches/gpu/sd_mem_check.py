"""Measures the CUDA allocator peaks of Stable Diffusion UNet LoRA training with diffusers + PEFT for
the runs listed in sd_mem_configs.json (each run in its own process, so nothing of an earlier run
stays cached).

The setup is the one of diffusers' examples/text_to_image/train_text_to_image_lora.py with cached
latents and text-encoder outputs: frozen UNet in the weight dtype, PEFT LoRA (gaussian init,
alpha = rank) on to_q/to_k/to_v/to_out.0, trainable parameters kept in fp32 (the script's
`cast_training_params`; done here for bf16 too, as lora-train does), torch.autocast in the weight
dtype (none for fp32), DDPM noising, epsilon MSE in fp32, torch.optim.AdamW, zero_grad(set_to_none).

    python benches/gpu/sd_mem_check.py OUT.json                 # all runs (CUDA)
    python benches/gpu/sd_mem_check.py --only s1,x1 OUT.json    # some runs
    python benches/gpu/sd_mem_check.py --one ID OUT.json        # one run (used by the above)
    SD_MEM_DEVICE=cpu python benches/gpu/sd_mem_check.py --only t1 OUT.json   # a smoke test

Peaks are reset after the model and adapter are built, so they are the training peaks with the
weights still counted. Predictions to compare with:
`cargo run -p lora-memory --example sd_gpu_check -- OUT.json`.
"""
import json, os, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = os.path.join(HERE, "sd_mem_configs.json")


def lora_unet(unet, rank, checkpointing):
    """The script's UNet setup: frozen base, PEFT LoRA r=alpha=`rank` (gaussian init) on
    to_q/to_k/to_v/to_out.0, the trainable parameters cast to fp32, train mode. Returns them."""
    from peft import LoraConfig

    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    if checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    return params


def ddpm():
    """SD's training noise schedule (scaled_linear 0.00085-0.012, 1000 steps)."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                         beta_schedule="scaled_linear")


def train_step(unet, sched, opt, latents, ehs, dtype, added=None, params=None, max_grad_norm=0.0):
    """One optimizer step on cached latents [b, 4, h/8, w/8] and text states [b, 77, d]: DDPM
    noising at uniform timesteps, autocast in `dtype` (none for fp32), epsilon MSE in fp32,
    backward, optional clipping of `params` by global norm, AdamW step, zero_grad(set_to_none).
    Returns the loss (a tensor on the device: reading it synchronises)."""
    import torch
    import torch.nn.functional as F

    dev = latents.device
    noise = torch.randn_like(latents)
    t = torch.randint(0, sched.config.num_train_timesteps, (latents.shape[0],), device=dev).long()
    noisy = sched.add_noise(latents, noise, t)
    with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
        pred = unet(noisy, t, ehs, added_cond_kwargs=added, return_dict=False)[0]
    loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
    loss.backward()
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def one(run_id, out_path):
    import torch
    from diffusers import UNet2DConditionModel

    spec = json.load(open(SPEC))
    run = next(r for r in spec["runs"] + spec.get("smoke", []) if r["id"] == run_id)
    cfg = spec["models"][run["model"]]
    dev = torch.device(os.environ.get("SD_MEM_DEVICE", "cuda"))
    cuda = dev.type == "cuda"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[run["dtype"]]
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # weights built in their dtype: no fp32 copy at load
    with torch.device(dev):
        unet = UNet2DConditionModel(**cfg)
    torch.set_default_dtype(torch.float32)
    params = lora_unet(unet, run["rank"], run["checkpointing"])
    opt = torch.optim.AdamW(params, lr=1e-4)
    sched = ddpm()
    b, lat = run["batch"], run["res"] // 8
    ctx_dim = cfg["cross_attention_dim"]
    added = None
    if cfg.get("addition_embed_type") == "text_time":
        pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
        added = {"text_embeds": torch.randn(b, pooled, device=dev, dtype=dtype),
                 "time_ids": torch.tensor([[run["res"], run["res"], 0, 0, run["res"], run["res"]]] * b,
                                          device=dev, dtype=dtype)}
    latents = torch.randn(b, 4, lat, lat, device=dev, dtype=dtype)
    ehs = torch.randn(b, 77, ctx_dim, device=dev, dtype=dtype)
    trainable = sum(p.numel() for p in params)
    if cuda:
        torch.cuda.synchronize()
        load_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(3):
        loss = train_step(unet, sched, opt, latents, ehs, dtype, added)
    res = dict(run, trainable_params=trainable, loss=float(loss), seconds=time.time() - t0,
               torch=torch.__version__)
    if cuda:
        torch.cuda.synchronize()
        res.update(max_allocated=torch.cuda.max_memory_allocated(),
                   max_reserved=torch.cuda.max_memory_reserved(), load_peak=load_peak,
                   gpu=torch.cuda.get_device_name(0))
    import diffusers, peft
    res.update(diffusers=diffusers.__version__, peft=peft.__version__)
    json.dump(res, open(out_path, "w"))


def main():
    args = sys.argv[1:]
    if args[0] == "--one":
        return one(args[1], args[2])
    only = None
    if args[0] == "--only":
        only = set(args[1].split(","))
        args = args[2:]
    out = args[0]
    spec = json.load(open(SPEC))
    runs = [r for r in spec["runs"] + spec.get("smoke", []) if only is None or r["id"] in only]
    results = []
    for r in runs:
        tmp = out + "." + r["id"] + ".tmp"
        t0 = time.time()
        p = subprocess.run([sys.executable, __file__, "--one", r["id"], tmp],
                           capture_output=True, text=True, timeout=300)
        if p.returncode == 0:
            res = json.load(open(tmp))
            os.remove(tmp)
        else:
            res = dict(r, error=p.stderr[-3000:])
        results.append(res)
        print(r["id"], "%.1fs" % (time.time() - t0),
              {k: res.get(k) for k in ("max_allocated", "max_reserved", "loss", "error")}, flush=True)
        json.dump({"results": results}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
