"""Reference data for `tests/sd/clip.rs`: a small CLIP BPE vocabulary, tiny CLIP text encoders
with random weights, a PEFT LoRA on one of them, and transformers' outputs for all of it.

No real CLIP vocabulary or weights are available offline, so everything is built here with a
fixed seed:
- merges learned by the `tokenizers` BPE trainer (CLIP's normaliser / pre-tokeniser, `</w>`
  suffix) on a small corpus, and a vocabulary laid out as OpenAI's `simple_tokenizer.py` does
  (256 byte symbols, the same with `</w>`, one entry per merge, then `<|startoftext|>`,
  `<|endoftext|>`), saved as `vocab.json` + `merges.txt` (SD's `tokenizer/` layout);
- ids from transformers' `CLIPTokenizer` (in transformers 5.x `CLIPTokenizerFast` is the same
  class, backed by `tokenizers`), and from an independent pure-Python port of OpenAI's
  `simple_tokenizer.py` BPE (without ftfy / HTML unescaping) as the "slow" reference;
- kohya sd-scripts' long-prompt chunks (`library/train_util.py::get_input_ids`) computed from
  transformers' ids;
- `CLIPTextModel` (quick_gelu, `eos_token_id` 2 → argmax pooling) and
  `CLIPTextModelWithProjection` (gelu, `eos_token_id` = the real EOS id → first-EOS pooling),
  hidden 32, 3 layers, 4 heads, vocab 1000, 77 positions, every parameter random;
- a PEFT LoRA (r 4, alpha 8, q/k/v/out_proj) on the first model with random A and B.

Usage: sd_clip.py --out DIR
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import regex  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers  # noqa: E402

SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""

CORPUS = [
    "a photo of a cat sitting on a red chair in the garden",
    "a painting of a dog, oil on canvas, highly detailed, trending on artstation",
    "portrait of a woman with long hair, studio lighting, 85mm, bokeh",
    "a futuristic city at night with neon lights and flying cars",
    "masterpiece, best quality, 1girl, solo, looking at viewer, smile",
    "landscape with mountains, a lake and pine trees under a cloudy sky",
    "the quick brown fox jumps over the lazy dog",
    "an astronaut riding a horse on the moon, photorealistic",
    "close-up of a flower with water drops, macro photography",
    "it's a beautiful day; we're going to the beach and they'll swim",
]

STRINGS = [
    "a photo of a cat",
    "A Photo   of a CAT!!",
    "  leading\tand trailing\nwhitespace  ",
    "numbers 12345 and 3.14, prices $9.99",
    "it's we're they'll I'd you've I'm don't",
    "unknown-words: zyxwvut qqq, emoji-free ascii only",
    "",
    "masterpiece, best quality, " * 30 + "the end",
]


def bytes_to_unicode():
    """GPT-2 / CLIP's reversible byte → printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def train_merges(n_merges):
    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", continuing_subword_prefix=""))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=10_000,
        min_frequency=1,
        end_of_word_suffix="</w>",
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]
    return merges[:n_merges]


class SimpleTokenizer:
    """OpenAI CLIP `simple_tokenizer.py`'s algorithm (without ftfy and HTML unescaping)."""

    def __init__(self, vocab, merges):
        self.byte_encoder = bytes_to_unicode()
        self.encoder = vocab
        self.ranks = {m: i for i, m in enumerate(merges)}
        self.pat = regex.compile(SPLIT, regex.IGNORECASE)

    def bpe(self, token):
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            first, second = best
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    out.append(first + second)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = tuple(out)
        return word

    def encode(self, text):
        text = regex.sub(r"\s+", " ", text).strip().lower()
        ids = []
        for token in regex.findall(self.pat, text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token))
        return ids


def kohya_chunks(tok, text, n_chunks):
    """sd-scripts `get_input_ids` with max_token_length = n_chunks·75 (+2)."""
    length = n_chunks * 75 + 2
    ids = tok(text, padding="max_length", truncation=True, max_length=length).input_ids
    out = []
    for i in range(1, length - 77 + 2, 75):
        chunk = [ids[0]] + ids[i : i + 75] + [ids[-1]]
        if tok.pad_token_id != tok.eos_token_id:
            if chunk[-2] != tok.eos_token_id and chunk[-2] != tok.pad_token_id:
                chunk[-1] = tok.eos_token_id
            if chunk[1] == tok.pad_token_id:
                chunk[1] = tok.eos_token_id
        out.append(chunk)
    return out


def randomize(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    out = a.out
    os.makedirs(out, exist_ok=True)

    # ---- tokenizer files (SD `tokenizer/` layout) ----
    merges = train_merges(400)
    symbols = list(bytes_to_unicode().values())
    symbols += [s + "</w>" for s in symbols]
    symbols += ["".join(m) for m in merges]
    symbols += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {s: i for i, s in enumerate(symbols)}
    assert len(vocab) == len(symbols), "duplicate symbols"
    tdir = os.path.join(out, "tokenizer")
    os.makedirs(tdir, exist_ok=True)
    with open(os.path.join(tdir, "vocab.json"), "w") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(tdir, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
        for m in merges:
            f.write(f"{m[0]} {m[1]}\n")

    from transformers import CLIPTokenizer, CLIPTokenizerFast

    tok = CLIPTokenizer.from_pretrained(tdir)
    fast = CLIPTokenizerFast.from_pretrained(tdir)
    bang = CLIPTokenizer.from_pretrained(tdir, pad_token="!")
    slow = SimpleTokenizer(vocab, merges)
    # the same tokenizer as transformers saves it (tokenizer.json + special_tokens_map etc.)
    bang.save_pretrained(os.path.join(out, "tokenizer_2"))

    enc = lambda t, s: t(s, padding="max_length", truncation=True, max_length=77).input_ids  # noqa: E731
    tokens = {
        "strings": STRINGS,
        "vocab_size": len(vocab),
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "ids": [enc(tok, s) for s in STRINGS],
        "ids_fast": [enc(fast, s) for s in STRINGS],
        "ids_pad_bang": [enc(bang, s) for s in STRINGS],
        "raw": [tok(s, add_special_tokens=False).input_ids for s in STRINGS],
        "raw_slow": [slow.encode(s) for s in STRINGS],
        "decoded": [tok.decode(tok(s, add_special_tokens=False).input_ids) for s in STRINGS],
        "chunks3": [kohya_chunks(tok, s, 3) for s in STRINGS],
        "chunks3_pad_bang": [kohya_chunks(bang, s, 3) for s in STRINGS],
    }
    with open(os.path.join(out, "tokens.json"), "w") as f:
        json.dump(tokens, f, ensure_ascii=False)

    # ---- tiny text encoders ----
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    gen = torch.Generator().manual_seed(1)
    common = dict(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=24,
        bos_token_id=tok.bos_token_id,
    )
    te1 = CLIPTextModel(CLIPTextConfig(hidden_act="quick_gelu", eos_token_id=2, pad_token_id=1, **common))
    te2 = CLIPTextModelWithProjection(
        CLIPTextConfig(hidden_act="gelu", eos_token_id=tok.eos_token_id, pad_token_id=0, **common)
    )
    randomize(te1, gen)
    randomize(te2, gen)
    te1.eval()
    te2.eval()
    te1.save_pretrained(os.path.join(out, "text_encoder"))
    te2.save_pretrained(os.path.join(out, "text_encoder_2"))

    ids1 = torch.tensor([tokens["ids"][i] for i in (0, 3, 7)], dtype=torch.int64)
    ids2 = torch.tensor([tokens["ids_pad_bang"][i] for i in (1, 4, 7)], dtype=torch.int64)
    ref = {"ids1": ids1, "ids2": ids2}
    with torch.no_grad():
        o = te1(ids1, output_hidden_states=True)
        ref["te1.last"] = o.last_hidden_state
        ref["te1.pooled"] = o.pooler_output
        ref["te1.penultimate"] = o.hidden_states[-2]
        ref["te1.clip_skip2"] = te1.final_layer_norm(o.hidden_states[-2])
        ref["te1.embeddings"] = o.hidden_states[0]
        o = te2(ids2, output_hidden_states=True)
        ref["te2.last"] = o.last_hidden_state
        ref["te2.text_embeds"] = o.text_embeds
        ref["te2.penultimate"] = o.hidden_states[-2]

    # ---- PEFT LoRA on the first encoder ----
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "out_proj"])
    peft_model = get_peft_model(te1, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    peft_model.eval()
    peft_model.save_pretrained(os.path.join(out, "peft_te1"))
    with torch.no_grad():
        o = peft_model(input_ids=ids1, output_hidden_states=True)
        ref["te1_lora.last"] = o.last_hidden_state
        ref["te1_lora.pooled"] = o.pooler_output
        ref["te1_lora.penultimate"] = o.hidden_states[-2]
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))


if __name__ == "__main__":
    main()
