"""triforce from Python: load a model once, then generate, stream, chat and keep a conversation.

    from triforce import LLM, SamplingParams

    llm = LLM()                                   # the default model, as `triforce generate` loads it
    print(llm.generate("The capital of France is").text)

Every choice of the CLI is a keyword of LLM with the same default (`--method auto` is
method="auto", `--no-hybrid` is hybrid=False, ...). Loading happens once; each call plans its
own context, so one LLM serves prompts of any length. The path from token ids to tokens is the
CLI's (triforce.app.completion.complete, app.chat.Chat, app.batch_generate), so greedy tokens equal
`triforce generate`'s. Library code prints nothing to stdout and never exits; bad values raise
triforce.UserError (BadValue, also a ValueError, for arguments) with the CLI's one-line message."""
from __future__ import annotations

from typing import Callable, Iterator

from triforce.app.llm_types import BadValue, CompletionOutput, Result, SamplingParams, check_messages, sampling_of
from triforce.errors import UserError

__all__ = ["LLM", "SamplingParams", "Result", "CompletionOutput", "BadValue"]


class LLM:
    def __init__(self, model: str = "default", *, method: str = "auto", draft: str | None = None,
                 device: str = "auto", dtype: str = "auto", quantize: str = "auto", max_context: int | None = None,
                 rope_scaling: str | None = None, profile: str | None = None, device_budget: str | None = None,
                 threads: int | None = None, tp: int = 1, attn: str = "auto", graphs: bool = True,
                 overlap: bool = True, hybrid: bool = True, draft_ahead: bool = False, budget: int | None = None,
                 chunk_size: int | None = None, gamma1: int | None = None, gamma2: int | None = None,
                 rebuild_stride: int | None = None, rebuild_threshold: float | None = None,
                 count_syncs: bool = False, parse_special_tokens: bool = False):
        """Load `model` (a Hugging Face folder, a .gguf file, or "default") once. The keywords are
        `triforce generate`'s flags; `triforce generate --help` explains each."""
        from triforce.config import RunConfig, build_spec

        if tp != 1:
            raise BadValue("tp > 1 runs one process per GPU: use `triforce generate --tp N` or `triforce serve --tp N`")
        try:
            spec, fixed = build_spec(method, budget, chunk_size, gamma1, gamma2, rebuild_stride, rebuild_threshold)
        except UserError as e:
            raise BadValue(str(e)) from None
        config = RunConfig(model=model, draft=draft, spec=spec, fixed=fixed, dtype=dtype, quantize=quantize,
                           device=device, profile=profile, device_budget=device_budget, attn=attn,
                           graphs="auto" if graphs else "off", overlap=overlap, hybrid=hybrid,
                           draft_ahead=draft_ahead, count_syncs=count_syncs, max_context=max_context,
                           rope_scaling=rope_scaling,
                           threads=threads, parse_special_tokens=parse_special_tokens)
        self._build(config)

    @classmethod
    def from_config(cls, config, rank: int = 0, world: int = 1) -> "LLM":
        """An LLM of a triforce.config.RunConfig (the CLI's parsed flags), as rank `rank` of
        `world` tensor-parallel processes (the CLI launches them)."""
        llm = cls.__new__(cls)
        llm._build(config, rank, world)
        return llm

    def _build(self, config, rank: int = 0, world: int = 1) -> None:
        from triforce.app.runtime import build_runtime

        self.config, self.world = config, world
        self.runtime = build_runtime(config, rank, world)
        self.tokenizer = self.runtime.lm.tokenizer
        self.context = self.runtime.context  # tokens a prompt and its answer may hold together

    def default_sampling_params(self) -> SamplingParams:
        """What a call without sampling parameters samples with: the model's generation_config.json
        (a GGUF file's general.sampling), else triforce's chat defaults (temperature 0.2, top-p
        0.9, repeat penalty 1.1); `.sampling_source` says which."""
        from triforce.model.sampling_defaults import model_sampling

        return SamplingParams.of(model_sampling(self.runtime.lm).params)

    get_default_sampling_params = default_sampling_params  # vLLM's name

    @property
    def sampling_source(self) -> str:
        from triforce.model.sampling_defaults import model_sampling

        return model_sampling(self.runtime.lm).describe()

    # ---- one prompt -------------------------------------------------------------------------
    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt: a string as `triforce generate --prompt` (chat: as --chat), or
        ids as given."""
        from triforce.app.completion import encode_prompt

        if isinstance(prompt, str):
            return encode_prompt(self.runtime.lm, prompt, chat, self.context, self.config.parse_special_tokens)
        ids = list(prompt)
        if not all(isinstance(i, int) and 0 <= i < self.runtime.lm.config.vocab_size for i in ids):
            raise BadValue(f"token ids must be integers in [0, {self.runtime.lm.config.vocab_size})")
        return ids

    def generate(self, prompts, params: SamplingParams | None = None, *, sampling_params: SamplingParams | None = None,
                 chat: bool = False, on_text: Callable[[str], None] | None = None,
                 on_prefill: Callable[[int, int], None] | None = None, **sampling):
        """One prompt (a string or token ids) -> a Result; a list of prompts -> a list of Results,
        decoded as one batch as `generate --prompts` does. params (or vLLM's sampling_params=):
        how to sample, by default the model's own (default_sampling_params); SamplingParams'
        fields as keywords replace its own (max_tokens=64). chat:
        wrap each prompt in the chat template (`--chat`). on_text: called with each piece of the
        (first) answer's text as it is decoded; on_prefill: with (prompt tokens prefilled so far,
        all to prefill) as a long prompt goes in (one prompt)."""
        params = sampling_of(params, sampling_params, sampling, self.default_sampling_params())
        if isinstance(prompts, (list, tuple)) and prompts and not isinstance(prompts[0], int):
            ids = [self.encode(p, chat) for p in prompts]
            if params.n == 1 and params.logprobs is None:
                from triforce.app.llm_modes import generate_batch

                return generate_batch(self, ids, params)
            return [self._answers(one, params) for one in ids]  # n answers or logprobs: one prompt at a time
        return self._answers(self.encode(prompts, chat), params, on_text, on_prefill)

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             on_text: Callable[[str], None] | None = None, on_prefill: Callable[[int, int], None] | None = None, *,
             sampling_params: SamplingParams | None = None, **sampling) -> Result:
        """The answer to a conversation given whole ([{"role": "user", "content": ...}, ...]),
        rendered with the model's chat template. Sampling as generate's."""
        from triforce.app.chat import render_messages

        params = sampling_of(params, sampling_params, sampling, self.default_sampling_params())
        check_messages(messages)
        ids = render_messages(self.tokenizer, messages, True, self.context, self.config.parse_special_tokens)
        return self._answers(ids, params, on_text, on_prefill)

    def stream(self, prompt, params: SamplingParams | None = None, *, chat: bool = False,
               sampling_params: SamplingParams | None = None, **sampling) -> Iterator[str]:
        """Yield the answer's text as it is decoded, in whole characters. Closing the iterator
        early stops decoding at the next round."""
        from triforce.app.llm_modes import stream_pieces

        params = sampling_of(params, sampling_params, sampling, self.default_sampling_params())
        if params.n != 1:
            raise BadValue("stream decodes one answer: n must be 1")
        return stream_pieces(self, self.encode(prompt, chat), params)

    def _answers(self, ids: list[int], params: SamplingParams, on_text=None, on_prefill=None) -> Result:
        """params.n answers to one prompt, one after another (answer i seeded from the seed and
        i, as the server's choices): the first's Result holding them all in .outputs."""
        from dataclasses import replace

        from triforce.decoding.sampling import choice_seed

        results = []
        for index in range(params.n):
            seed = None if params.seed is None else choice_seed(params.seed, index)
            results.append(self.complete_ids(ids, replace(params, seed=seed), on_text if index == 0 else None,
                                             on_prefill=on_prefill if index == 0 else None))
        first = results[0]
        first.outputs = [replace(r.outputs[0], index=i) for i, r in enumerate(results)]
        return first

    def conversation(self, system: str | None = None):
        """A chat whose KV stays between turns (as `triforce chat`): .send(text, params) -> Result."""
        from triforce.app.llm_modes import Conversation

        return Conversation(self, system)

    def complete_ids(self, ids: list[int], params: SamplingParams, on_text=None, stop_flag=None, on_prefill=None,
                     before_prefill=None) -> Result:
        """generate's path for token ids, with the hooks the CLI uses too: stop_flag (a
        threading.Event) stops at the next round; before_prefill(run plan) runs once the plan is
        made. The Result's .completion holds the engine and plan it ran with."""
        from triforce.app.completion import prefilled, room_for, summary_of
        from triforce.app.stop_text import StopText
        from triforce.app.textstream import TextStream

        from triforce.decoding.logprobs import LogprobRecorder

        lm = self.runtime.lm
        new = room_for(ids, self.context, params.max_tokens)
        recorder = None if params.logprobs is None else LogprobRecorder(top=params.logprobs)
        stream, stops = TextStream(self.tokenizer), StopText(list(params.stop))
        pieces: list[str] = []

        def token(t: int) -> None:
            piece = stops.feed(stream.push(t))
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)

        so_far = [0]

        def progress(n: int) -> None:
            so_far[0] += n
            on_prefill(so_far[0], len(ids) - 1)

        with prefilled(self.runtime, ids, new, progress=progress if on_prefill is not None else None,
                       before_prefill=before_prefill) as ready:
            result = ready.engine.generate(new, params.engine_params(), frozenset() if params.ignore_eos else lm.eos_ids,
                                           on_token=token, logprobs=recorder,
                                           stop_requested=lambda: stops.matched or bool(stop_flag and stop_flag.is_set()))
        done = ready.completion(result)
        if not stops.matched:
            rest = stops.feed(stream.text()[stream.emitted:]) + stops.flush()
            if rest:
                pieces.append(rest)
                if on_text is not None:
                    on_text(rest)
        stats = summary_of(self.runtime, done, self.world)
        stopped = "stop" if stops.matched else done.result.stopped_by
        stats["stopped_by"] = stopped
        text, tokens, reason = "".join(pieces), list(done.result.tokens), Result.finish_reason_of(stopped)
        output = CompletionOutput(0, text, tokens, reason)
        if recorder is not None:
            output.logprobs = [{e.token: e.logprob, **dict(e.top)} for e in recorder.entries]
            output.cumulative_logprob = sum(e.logprob for e in recorder.entries)
        answer = Result(text, tokens, reason, stats, [output], list(ids))
        answer.completion = done  # not a field: the engine and plan, for the CLI's summary and traces
        return answer
