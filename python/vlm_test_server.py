"""An OpenAI-compatible chat server for testing image requests, on loopback.

No vision-language model ships in the package registries, so `lora-train tag` with a `vlm`
section is tested against this server. It accepts a request only when

1. llama-cpp-python's OpenAI server accepts it: the body validates against that server's own
   request model (`llama_cpp.server.types.CreateChatCompletionRequest`, pydantic), and
2. it has the shape vLLM's and llama.cpp's documentation give for an image: one user message
   whose content is a list of a `{"type": "text", "text"}` part and an
   `{"type": "image_url", "image_url": {"url": "data:image/<png|jpeg|webp|gif>;base64,…"}}` part,
   the base64 decoding (strictly) to an image of that MIME type that PIL opens,

and answers 400 with the reason otherwise (the reason is also logged). The reply describes what
arrived, so a test can check that each image reached the request for it, unchanged or scaled:

- an instruction asking for tags gets `"<format>, <width>x<height>, sha <first 12 hex of the
  sha256 of the image bytes>"`;
- any other instruction gets `"Caption: A <width>x<height> <format> image, sha <12 hex>."`.

Every request body is appended to `--log` (JSON lines) with the verdict.

    python vlm_test_server.py --port 0 --log requests.jsonl
    (prints "PORT <n>" once listening; stops on SIGTERM or stdin closing)
"""

import argparse
import base64
import binascii
import hashlib
import io
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image
from llama_cpp.server.types import CreateChatCompletionRequest

DATA_URL = re.compile(r"^data:(image/(png|jpeg|webp|gif));base64,([A-Za-z0-9+/=]+)$")
PIL_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}


def check(body):
    """The image's (mime, bytes, instruction) or raise ValueError with the reason."""
    CreateChatCompletionRequest.model_validate(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) != 1:
        raise ValueError("expected exactly one message (the user turn), got %r" % (messages,))
    m = messages[0]
    if m.get("role") != "user":
        raise ValueError("the message role must be 'user', got %r" % m.get("role"))
    content = m.get("content")
    if not isinstance(content, list) or len(content) != 2:
        raise ValueError("the content must be a list of a text part and an image_url part")
    text, image = content
    if text.get("type") != "text" or not isinstance(text.get("text"), str) or not text["text"].strip():
        raise ValueError("the first part must be {'type': 'text', 'text': <instruction>}")
    if set(image) != {"type", "image_url"} or image["type"] != "image_url":
        raise ValueError("the second part must be {'type': 'image_url', 'image_url': {...}}")
    url = image["image_url"]
    if not isinstance(url, dict) or set(url) - {"url", "detail"}:
        raise ValueError("image_url must be an object {'url': ...}")
    match = DATA_URL.match(url.get("url", ""))
    if not match:
        raise ValueError("the url must be a base64 data URL of a PNG, JPEG, WebP or GIF image")
    mime, data = match.group(1), match.group(3)
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise ValueError("the base64 payload does not decode: %s" % e)
    img = Image.open(io.BytesIO(raw))
    img.load()
    if img.format != PIL_FORMATS[mime]:
        raise ValueError("the data URL says %s but the bytes are %s" % (mime, img.format))
    for key, kind in (("max_tokens", int), ("temperature", (int, float)), ("stream", bool)):
        if not isinstance(body.get(key), kind):
            raise ValueError("%s must be a %s" % (key, kind))
    if body["stream"]:
        raise ValueError("stream must be false")
    return img, raw, text["text"]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        raw_body = self.rfile.read(length)
        entry = {"path": self.path, "authorization": self.headers.get("Authorization")}
        try:
            if self.path != "/v1/chat/completions":
                raise LookupError("no route %s" % self.path)
            body = json.loads(raw_body)
            entry["body"] = body
            img, raw, instruction = check(body)
        except LookupError as e:
            entry["verdict"] = str(e)
            self.server.log(entry)
            return self.send_json(404, {"error": {"message": str(e)}})
        except Exception as e:  # the reason goes back to the client, as a server's 400 would
            entry["verdict"] = "rejected: %s" % e
            self.server.log(entry)
            return self.send_json(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
        sha = hashlib.sha256(raw).hexdigest()[:12]
        w, h = img.size
        fmt = img.format.lower()
        if "tags" in instruction.lower():
            reply = "%s, %dx%d, sha %s" % (fmt, w, h, sha)
        else:
            reply = "Caption: A %dx%d %s image, sha %s." % (w, h, fmt, sha)
        entry["verdict"] = "accepted"
        entry["reply"] = reply
        # the image payload is long; keep only its length in the log
        part = body["messages"][0]["content"][1]["image_url"]
        part["url"] = "<%d characters>" % len(part["url"])
        self.server.log(entry)
        self.send_json(200, {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        })


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, log_path):
        super().__init__(addr, Handler)
        self.log_path = log_path
        self.lock = threading.Lock()

    def log(self, entry):
        if self.log_path:
            with self.lock, open(self.log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log", default=None)
    args = ap.parse_args()
    server = Server(("127.0.0.1", args.port), args.log)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("PORT %d" % server.server_address[1], flush=True)
    # stop when the parent closes stdin (or dies)
    sys.stdin.read()
    server.shutdown()


if __name__ == "__main__":
    main()
