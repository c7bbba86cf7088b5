"""The GPU campaign's first step: what a new user types, with default flags, on this machine.

    python -m triforce.bench.campaign.user_step [--json] [--keep DIR]

A random-weight Llama folder is made on the spot (safetensors, and a character tokenizer with a
ChatML chat template built here: nothing is downloaded). Then, each as its own process and each
required to exit 0:
  generate          greedy (generate's default), default device, dtype and profile
  generate-sampled  --temperature 0.8 --seed 1
  generate-float32  greedy in float32 (--ignore-eos), whose tokens must equal transformers' own
                    `generate` on the same device and weights (compared here)
  chat              piped input: a question, /stats, /quit
  serve             one chat completion through the openai client (httpx when openai is absent)
A failing command is recorded and the rest still run; the exit status is 1 if any failed.
The commands are not memory-capped: a user's are not."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from triforce.bench.campaign.stacks import TAIL, communicate, with_stacks
from triforce.bench.harness import last_json  # the campaign reads its steps' output the same way

PROMPT = "the capital of france is"
NEW_TOKENS = 24
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_model(folder: Path, seed: int = 0) -> Path:
    """A 4-layer GQA Llama (hidden 256) with random weights wide enough for peaked logits."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in string.ascii_letters + string.digits + " .,!?'\n:;-":
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def triforce_argv() -> list[str]:
    """The installed `triforce` command, else the module it runs."""
    found = shutil.which("triforce")
    return [found] if found else [sys.executable, "-m", "triforce.cli.main"]


def run(name: str, args: list[str], stdin: str | None = None, timeout_s: float = 60) -> dict:
    started = time.perf_counter()
    proc = subprocess.Popen(triforce_argv() + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=with_stacks())
    rc, out, err = communicate(proc, timeout_s, stdin or "")
    return {"name": name, "command": "triforce " + " ".join(args), "rc": rc, "ok": rc == 0,
            "seconds": round(time.perf_counter() - started, 1), "stdout_tail": out[-1500:],
            "stderr_tail": err[-(TAIL if rc == "timeout" else 1500):], "json": last_json(out)}


def transformers_tokens(folder: Path, device: str) -> list[int]:
    """NEW_TOKENS greedy tokens of transformers' own generate in float32 on `device`, past any
    EOS (as `--ignore-eos`), so the whole length is compared."""
    import torch
    from transformers import AutoTokenizer

    from triforce.model.loading import transformers_model

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = transformers_model(Path(folder), torch.float32).to(device)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.to(device)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def serve_once(folder: Path, timeout_s: float = 60) -> dict:
    """`triforce serve` on a free port, one chat completion, then Ctrl-C as a terminal sends it: SIGINT
    to serve's whole process group (its own here, a wrapper script's processes included)."""
    started = time.perf_counter()
    args = ["serve", "--model", str(folder), "--port", "0"]
    proc = subprocess.Popen(triforce_argv() + args, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=with_stacks(), start_new_session=True)
    record = {"name": "serve", "command": "triforce " + " ".join(args), "ok": False, "json": None}
    lines: list[str] = []
    try:
        url = None
        for line in proc.stderr:
            lines.append(line)
            found = re.search(r"listening on (http://\S+/v1)", line)
            if found:
                url = found.group(1)
                break
            if time.perf_counter() - started > timeout_s:
                break
        if url is None:
            raise RuntimeError("the server printed no 'listening on' line")
        record["client"], record["json"] = _ask(url)
        signalled = time.perf_counter()
        os.killpg(proc.pid, signal.SIGINT)
        record["rc"], _, rest = communicate(proc, 30)  # still running then: its threads' stacks
        record["stopped_s"] = round(time.perf_counter() - signalled, 2)  # the goal: 2 s
        lines.append(rest)
        if record["rc"] == "timeout":
            record["error"] = "it did not stop within 30 s of Ctrl-C (its threads' stacks end stderr_tail)"
        record["ok"] = record["rc"] == 0 and bool(record["json"]["content"] is not None)
    except Exception as e:  # noqa: BLE001 - recorded, and the campaign goes on
        record["error"] = f"{type(e).__name__}: {e}"
        record.setdefault("rc", proc.poll())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    record.update(seconds=round(time.perf_counter() - started, 1),
                  stderr_tail="".join(lines)[-(1500 if record["ok"] else TAIL):])
    return record


def _ask(url: str) -> tuple[str, dict]:
    messages = [{"role": "user", "content": "Say hello."}]
    try:
        import openai
    except ImportError:
        import httpx
        reply = httpx.post(f"{url}/chat/completions", timeout=60,
                           json={"model": "m", "messages": messages, "max_tokens": 8}).raise_for_status().json()
        choice = reply["choices"][0]
        return "httpx (openai not installed)", {"content": choice["message"]["content"],
                                                "finish_reason": choice["finish_reason"]}
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    choice = reply.choices[0]
    return f"openai {openai.__version__}", {"content": choice.message.content, "finish_reason": choice.finish_reason}


def user_step(folder: Path) -> dict:
    import torch

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    make_model(folder)
    made_s = round(time.perf_counter() - started, 1)
    base = ["generate", "--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--json"]
    steps = [run("generate", base),
             run("generate-sampled", base + ["--temperature", "0.8", "--seed", "1"]),
             run("generate-float32", base + ["--dtype", "float32", "--ignore-eos"]),
             run("chat", ["chat", "--model", str(folder), "--max-new-tokens", "16"],
                 stdin="what is the capital of france?\n/stats\n/quit\n"),
             serve_once(folder)]
    chat = steps[3]
    if chat["ok"] and "context" not in chat["stdout_tail"] + chat["stderr_tail"]:
        chat.update(ok=False, error="/stats printed no context line")
    ours = (steps[2]["json"] or {}).get("tokens")
    reference = transformers_tokens(folder, device)
    agree = ours == reference
    if not agree:
        steps[2].update(ok=False, error="float32 greedy tokens differ from transformers' generate")
    return {"device": device, "model_made_s": made_s, "seconds": round(time.perf_counter() - started, 1),
            "ok": all(s["ok"] for s in steps), "greedy_float32_equals_transformers": agree,
            "tokens": ours, "transformers_tokens": reference,
            "default_dtype": (steps[0]["json"] or {}).get("dtype"), "steps": steps}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the random model here and keep it (default: a temporary folder).")
def main(as_json: bool, keep: Path | None) -> None:
    """Run the commands a new user types, with default flags, on a model made here."""
    with tempfile.TemporaryDirectory(prefix="triforce-user-step-") as tmp:
        folder = keep or Path(tmp) / "random-llama"
        report = user_step(folder)
    if as_json:
        print(json.dumps(report))
    else:
        for s in report["steps"]:
            status = "ok" if s["ok"] else f"FAILED (exit {s.get('rc')}) {s.get('error', '')}"
            print(f"{s['name']:17s} {status:10s} {s['seconds']:6.1f} s  {s['command']}")
        print(f"greedy float32 tokens equal transformers' generate on {report['device']}: "
              f"{report['greedy_float32_equals_transformers']}")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
