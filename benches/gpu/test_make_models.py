"""Tests of make_models.py on its tiny shapes (the full-size ones write GBs):

    .venv/bin/python -m unittest benches/gpu/test_make_models.py
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import make_models  # noqa: E402


class TinyModels(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.out = cls.tmp.name
        r = subprocess.run(
            [sys.executable, os.path.join(HERE, "make_models.py"), cls.out, "--tiny"],
            capture_output=True,
            text=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
        if r.returncode != 0:
            raise AssertionError(f"make_models.py --tiny failed:\n{r.stdout}\n{r.stderr}")
        cls.stdout = r.stdout

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_llm_loads_in_transformers_with_the_config_shapes(self):
        import torch
        from transformers import AutoModelForCausalLM

        folder = os.path.join(self.out, "tiny-llama")
        spec = make_models.LLMS["tiny-llama"]
        model = AutoModelForCausalLM.from_pretrained(folder)
        self.assertEqual(model.dtype, torch.bfloat16)
        layer = model.model.layers[0]
        self.assertEqual(tuple(layer.self_attn.q_proj.weight.shape), (spec["num_attention_heads"] * spec["head_dim"], spec["hidden_size"]))
        self.assertEqual(tuple(layer.self_attn.k_proj.weight.shape), (spec["num_key_value_heads"] * spec["head_dim"], spec["hidden_size"]))
        self.assertEqual(tuple(layer.mlp.down_proj.weight.shape), (spec["hidden_size"], spec["intermediate_size"]))
        self.assertEqual(len(model.model.layers), spec["num_hidden_layers"])
        self.assertEqual(model.config.rope_scaling["rope_type"], "llama3")
        # tied embeddings: one tensor, as the published 1B/3B checkpoints
        self.assertEqual(model.lm_head.weight.data_ptr(), model.model.embed_tokens.weight.data_ptr())
        # random init, not zeros: transformers' normal(0, initializer_range)
        std = model.model.layers[0].mlp.up_proj.weight.float().std().item()
        self.assertAlmostEqual(std, spec["initializer_range"], delta=0.005)
        logits = model(torch.tensor([[256, 72, 105]])).logits
        self.assertEqual(tuple(logits.shape), (1, 3, spec["vocab_size"]))
        self.assertTrue(torch.isfinite(logits).all().item())

    def test_tokenizer_maps_bytes_to_ids_with_bos_first(self):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.path.join(self.out, "tiny-llama"))
        text = "Hi é"
        ids = tok(text)["input_ids"]
        self.assertEqual(ids, [256] + list(text.encode("utf-8")))
        self.assertEqual(tok.decode(ids, skip_special_tokens=True), text)

    def test_unet_loads_in_diffusers_and_runs(self):
        import torch
        from diffusers import UNet2DConditionModel

        spec = make_models.UNETS["tiny-unet"]
        from safetensors import safe_open

        folder = os.path.join(self.out, "tiny-unet", "unet")
        with safe_open(os.path.join(folder, "diffusion_pytorch_model.safetensors"), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        self.assertEqual(dtypes, {"F16"})
        unet = UNet2DConditionModel.from_pretrained(folder)
        self.assertEqual(list(unet.config.block_out_channels), spec["block_out_channels"])
        unet = unet.float()
        s = spec["sample_size"]
        out = unet(torch.randn(1, 4, s, s), 10, encoder_hidden_states=torch.randn(1, 7, spec["cross_attention_dim"])).sample
        self.assertEqual(tuple(out.shape), (1, 4, s, s))

    def test_sd_pipeline_loads_in_diffusers_and_encodes_a_prompt(self):
        import torch
        from diffusers import StableDiffusionPipeline

        folder = os.path.join(self.out, "tiny-sd")
        for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
            self.assertTrue(os.path.isdir(os.path.join(folder, part)), part)
        from safetensors import safe_open

        for part, f in (("unet", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"), ("text_encoder", "model")):
            with safe_open(os.path.join(folder, part, f + ".safetensors"), "pt") as h:
                self.assertEqual({h.get_slice(k).get_dtype() for k in h.keys()}, {"F16"}, part)
        pipe = StableDiffusionPipeline.from_pretrained(folder)
        # the tiny configs of lora-train's SD test fixture
        mp = make_models.sd_fixture_module()
        self.assertEqual(list(pipe.unet.config.block_out_channels), list(mp.UNET["block_out_channels"]))
        self.assertEqual(list(pipe.vae.config.block_out_channels), list(mp.VAE["block_out_channels"]))
        ids = pipe.tokenizer(["shapes, red circle"], padding="max_length", max_length=77, return_tensors="pt").input_ids
        self.assertEqual(ids[0, 0].item(), pipe.tokenizer.bos_token_id)
        states = pipe.text_encoder.float()(ids)[0]
        self.assertEqual(tuple(states.shape), (1, 77, pipe.unet.config.cross_attention_dim))
        self.assertTrue(torch.isfinite(states).all().item())

    def test_images_are_a_kohya_folder_with_captions(self):
        from PIL import Image

        n, side = make_models.IMAGES["tiny-images"]
        d = os.path.join(self.out, "tiny-images", "1_shapes")
        pngs = sorted(f for f in os.listdir(d) if f.endswith(".png"))
        self.assertEqual(len(pngs), n)
        for f in pngs:
            img = Image.open(os.path.join(d, f))
            self.assertEqual((img.size, img.mode), ((side, side), "RGB"))
            cap = open(os.path.join(d, f[:-4] + ".txt")).read()
            self.assertTrue(cap.startswith("shapes, "), cap)
            words = cap.strip().split(", ")[1:]
            self.assertTrue(words and all(w.split()[0] in make_models.COLOURS and w.split()[1] in make_models.SHAPES for w in words), cap)
        # not one flat colour: shapes and gradient differ across the image
        import numpy as np

        a = np.asarray(Image.open(os.path.join(d, pngs[0]))).astype(np.float32)
        self.assertGreater(a.std(), 10.0)

    def test_sd15_shapes_give_the_published_parameter_counts(self):
        # Counted on the meta device. Published (stable-diffusion-v1-5): UNet 859.52 M,
        # VAE 83.65 M, CLIP ViT-L/14 text encoder 123.06 M.
        import torch
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel

        spec = make_models.PIPELINES["sd15"]
        with torch.device("meta"):
            unet = UNet2DConditionModel(**make_models.UNETS[spec["unet"]])
            vae = AutoencoderKL(**spec["vae"])
            te = CLIPTextModel(CLIPTextConfig(hidden_act="quick_gelu", **spec["text"]))
        for m, millions in ((unet, 859.52), (vae, 83.65), (te, 123.06)):
            n = sum(p.numel() for p in m.parameters()) / 1e6
            self.assertAlmostEqual(n, millions, delta=0.05, msg=type(m).__name__)

    def test_second_run_keeps_the_folders(self):
        weights = os.path.join(self.out, "tiny-llama", "model.safetensors")
        before = os.stat(weights).st_mtime_ns
        r = subprocess.run(
            [sys.executable, os.path.join(HERE, "make_models.py"), self.out, "tiny-llama"],
            capture_output=True,
            text=True,
        )
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("kept", r.stdout)
        self.assertEqual(os.stat(weights).st_mtime_ns, before)
        self.assertEqual(json.load(open(os.path.join(self.out, "models.json"))), {"tiny-llama": os.path.join(self.out, "tiny-llama")})

    def test_published_shapes_give_the_published_parameter_counts(self):
        # Counted on the meta device: no memory. Published sizes: Llama-3.2-1B 1.24 B,
        # Llama-3.2-3B 3.21 B, Llama-3.1-8B 8.03 B, Qwen2.5-7B 7.62 B (model cards).
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        published = {"llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "llama-3.1-8b": 8.03, "qwen2.5-7b": 7.62}
        for name, billions in published.items():
            with torch.device("meta"):
                m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(json.dumps(make_models.LLMS[name]))))
            n = sum(p.numel() for p in m.parameters()) / 1e9
            self.assertAlmostEqual(n, billions, delta=0.01, msg=name)

    def test_unknown_name_is_an_error_listing_the_known_ones(self):
        r = subprocess.run(
            [sys.executable, os.path.join(HERE, "make_models.py"), self.out, "llama-9"],
            capture_output=True,
            text=True,
        )
        self.assertEqual(r.returncode, 2)
        self.assertIn("llama-3.2-1b", r.stderr)


if __name__ == "__main__":
    unittest.main()
