"""A stand-in for llama.cpp's llama-server, as `triforce bench serve-ttft --llama-server` talks to
it: its flags (refusing what llama-server refuses: an unknown flag, a missing model file), GET
/health, and POST /v1/chat/completions streamed with the last chunk's usage and `timings.cache_n`
(the prompt it reused from its one slot, counted in characters as its tokens). It writes its
arguments to $FAKE_LLAMA_ARGS."""
import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FLAGS = ("-m", "-c", "-np", "-t", "-tb", "--rope-scaling", "--rope-scale", "--host", "--port")


class Slot:
    prompt = ""  # what the one slot's cache holds


def _prompt(body: dict) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in body["messages"]) + "<assistant>"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = _prompt(body)
        cached = len(os.path.commonprefix([Slot.prompt, prompt]))
        Slot.prompt = prompt
        words = ["The", " document", " says", " little", "."][:body["max_tokens"]]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in words:
            self._send({"choices": [{"index": 0, "delta": {"content": word}}]})
        self._send({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(words)},
                    "timings": {"cache_n": cached, "prompt_n": len(prompt) - cached}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, chunk: dict) -> None:
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in FLAGS:
        parser.add_argument(flag)
    args = parser.parse_args()
    Path(os.environ["FAKE_LLAMA_ARGS"]).write_text(json.dumps(sys.argv[1:]))
    if not Path(args.m).is_file():
        sys.exit(f"error: failed to load model '{args.m}'")
    ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()


if __name__ == "__main__":
    main()
