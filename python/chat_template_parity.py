"""Renders a table of conversations with real models' chat templates through transformers' own
`apply_chat_template` machinery, as the reference for lora-data's Jinja chat templates
(`lora-data/tests/data/chat_templates.rs` compares byte for byte).

Run with the project's venv python (transformers + Jinja2):

    python chat_template_parity.py --templates assets/chat_templates --out expected.json

`--templates` is the folder `cargo xtask setup` fills from llama.cpp's `models/templates/`. Each
rendering goes through `transformers.utils.chat_template_utils.render_jinja_template`, the function
`PreTrainedTokenizerBase.apply_chat_template(..., tokenize=False)` calls with the tokenizer's special
tokens; the BOS/EOS strings below are those of each model's `tokenizer_config.json`. A template that
refuses a conversation (`raise_exception`) is recorded with its message instead of a text.
"""

import argparse
import json
import os

from jinja2.exceptions import TemplateError
from transformers.utils.chat_template_utils import render_jinja_template

# template file -> (bos_token, eos_token) of the model's tokenizer_config.json
TEMPLATES = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("<s>", "</s>"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("", "<|im_end|>"),
    "google-gemma-2-2b-it.jinja": ("<bos>", "<eos>"),
    "Qwen-Qwen3-0.6B.jinja": ("", "<|im_end|>"),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("<s>", "<|endoftext|>"),
    "HuggingFaceTB-SmolLM3-3B.jinja": ("", "<|im_end|>"),
}

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris."}
U2 = {"role": "user", "content": "And of Italy?"}
A2 = {"role": "assistant", "content": "Rome."}
U_WS = {"role": "user", "content": "  Héllo wörld — ünïcode 日本語 \n"}
A_WS = {"role": "assistant", "content": " Sure!\n\nLine two. "}

# (conversation, add_generation_prompt)
CONVERSATIONS = [
    ([U1], True),
    ([U1], False),
    ([SYSTEM, U1], True),
    ([U1, A1], False),
    ([SYSTEM, U1, A1], False),
    ([U1, A1, U2, A2], False),
    ([U1, A1, U2], True),
    ([SYSTEM, U1, A1, U2], True),
    ([SYSTEM, U1, A1, U2, A2], False),
    ([U_WS, A_WS], False),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--templates", required=True, help="folder of .jinja chat templates")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args()
    cases = []
    for name, (bos, eos) in TEMPLATES.items():
        with open(os.path.join(args.templates, name), encoding="utf-8") as f:
            source = f.read()
        for messages, add_generation_prompt in CONVERSATIONS:
            case = {
                "template": name,
                "bos_token": bos,
                "eos_token": eos,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "text": None,
                "error": None,
            }
            try:
                rendered, _ = render_jinja_template(
                    conversations=[messages],
                    chat_template=source,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=bos,
                    eos_token=eos,
                )
                case["text"] = rendered[0]
            except TemplateError as e:
                case["error"] = str(e)
            cases.append(case)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"cases": cases}, f, ensure_ascii=False, indent=1)
    os.replace(tmp, args.out)
    errors = sum(c["error"] is not None for c in cases)
    print(f"{len(cases)} renderings ({errors} refused by their template) -> {args.out}")


if __name__ == "__main__":
    main()
