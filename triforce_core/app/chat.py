"""Multi-turn chat over one Engine: the conversation is re-rendered with the chat template
each turn and only the tokens past the longest common prefix are prefilled."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from triforce.app.inputs import check_text_file, read_text_file, text_bound
from triforce.app.threads import threads_in_use
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.engine import Engine
from triforce.decoding.numerics import SYMPTOMS, located
from triforce.decoding.statistics import GenerationResult
from triforce.errors import UserError
from triforce.model.chat_template import chat_ids, pieces_ids
from triforce.model.loading import LoadedModel

PLAIN_TEMPLATE_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


def render_messages(tokenizer, messages: list[dict], add_generation_prompt: bool, max_len: int,
                    parse_special: bool = False) -> list[int]:
    """A conversation's token ids: the model's chat template (as `generate --chat`), or for base
    models a plain transcript. max_len: the context (bounds the rendered text). Text inside a
    message stays text unless parse_special (triforce.model.chat_template.chat_ids)."""
    if getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, messages, add_generation_prompt, text_bound(max_len), parse_special)
    pieces = []
    for m in messages:
        pieces += [(f"{PLAIN_TEMPLATE_ROLES[m['role']]}: ", True), (m["content"], False), ("\n\n", True)]
    if add_generation_prompt:
        pieces.append(("Assistant:", True))
    return pieces_ids(tokenizer, pieces, parse_special)


class Chat:
    def __init__(self, lm: LoadedModel, max_len: int, system: str | None = None,
                 spec: SpecParams = SpecParams(), draft=None, kv_cache=None, engine: Engine | None = None,
                 stop_requested: Callable[[], bool] | None = None):
        """engine: one built by the runtime builder (triforce.app.runtime); without it, a plain
        engine of max_len tokens over `kv_cache` (default resident) with `spec` and `draft`.
        stop_requested: asked before each round of an answer (Ctrl-C under tensor parallelism)."""
        self.lm, self.stop_requested = lm, stop_requested
        self.engine = engine or Engine(lm, spec, max_len, draft, kv_cache)
        self.full = self.engine.full
        self.system = system
        self.messages: list[dict] = self._initial_messages()
        self.last_answer: GenerationResult | None = None
        self.last_prefill_tokens = 0

    def _initial_messages(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return render_messages(self.lm.tokenizer, messages, add_generation_prompt, self.full.max_len)

    def _sync(self, messages: list[dict], add_generation_prompt: bool,
              progress: Callable[[int], None] | None, on_total: Callable[[int], None] | None) -> None:
        ids = self.render(messages, add_generation_prompt)
        if len(ids) >= self.full.max_len:
            alone = self.render(self._initial_messages() + messages[-1:], add_generation_prompt)
            if len(alone) >= self.full.max_len:  # /reset cannot help
                raise UserError(f"this message alone is {len(alone)} tokens but the context holds "
                                f"{self.full.max_len} (start the chat with a larger --max-context)")
            raise UserError(f"the conversation is {len(ids)} tokens but the context holds "
                            f"{self.full.max_len}; /reset to start over")
        if on_total is not None:
            on_total(len(ids) - 1 - self.full.reusable_prefix(ids[:-1]))
        before = self.engine.seq
        try:
            self.last_prefill_tokens = self.engine.set_sequence(ids, progress)
        except BaseException:  # Ctrl-C during a /load: the conversation (and /stats) stay as they were
            self.engine.seq = before
            raise

    def load_document(self, path: Path, progress=None, on_total=None) -> int:
        """Put a document into the context now, so the next question starts fast."""
        whole = self.full.max_len
        left = whole - len(self.engine.seq)
        room = f"the {left} tokens left in the context (/reset, or a larger --max-context)"
        if check_text_file(path, "document").stat().st_size > text_bound(whole):  # /reset cannot help
            room = f"the whole {whole}-token context (start the chat with a larger --max-context)"
        text = read_text_file(path, "document", text_bound(left), room, errors="replace")
        message = {"role": "user", "content": f"Here is the document {path.name}:\n\n{text}"}
        candidate = self.messages + [message]
        self._sync(candidate, False, progress, on_total)
        self.messages = candidate
        return len(self.full.tokens)

    def ask(self, question: str, params: SamplingParams, max_new_tokens: int,
            on_token: Callable[[int], None] | None = None, progress=None, on_total=None) -> GenerationResult:
        candidate = self.messages + [{"role": "user", "content": question}]
        self._sync(candidate, True, progress, on_total)
        self.messages = candidate
        try:
            result = self.engine.generate(max_new_tokens, params, self.lm.eos_ids, on_token,
                                          stop_requested=self.stop_requested)
        except SYMPTOMS as e:  # the turn is dropped and the caches refilled from the text next turn
            error = located(e, self.lm, self.engine.seq)
            self.messages.pop()
            self.full.truncate(0)
            raise error from None
        answer = self.lm.tokenizer.decode(result.tokens, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": answer})
        self.last_answer = result
        return result

    def reset(self) -> None:
        self.messages = self._initial_messages()
        self.full.truncate(0)
        self.engine.seq = []

    def stats(self) -> dict:
        s = self.full
        last = self.last_answer
        speculation = last.stats if last else {}
        return {
            "context_tokens": len(self.engine.seq),
            "context_capacity": self.full.max_len,
            "turns": sum(m["role"] == "assistant" for m in self.messages),
            "last_answer_tokens": len(last.tokens) if last else 0,
            "last_answer_tokens_per_s": round(len(last.tokens) / last.time_s, 2) if last and last.time_s else None,
            "last_prefill_tokens": self.last_prefill_tokens,
            "prefill_tokens_per_s": round(s.prefill_tokens / s.prefill_s, 1) if s.prefill_s else None,
            "tiers": self.engine.describe(),
            "acceptance_rates": speculation.get("acceptance_rates"),
            "mean_tokens_per_full_verify": speculation.get("mean_tokens_per_full_verify"),
            "tier_time_s": speculation.get("tier_time_s"),
            "threads": threads_in_use(),
            "kv_cache_bytes": self.full.cache.nbytes,
            "kv_host_bytes": self.full.cache.host_nbytes,
        }
