"""What a static tree for the full verify would be worth (issue 41 item 6, not built): how often,
where the full verify rejects a draft, one alternative token beside it would have been taken.

    python -m triforce.bench.static_tree [--prompt-tokens 8000] [--new-tokens 192] [--temperatures 0,0.7]

One prefill of a natural-text prompt, then triforce (lookup -> retrieval -> full, the GPU
campaign's tiers) decodes as it does today, and every full verify that rejects a draft is looked
at: with one alternative per draft (a width-2 comb, 2 * gamma2 + 1 queries in one pass), the
alternative at the rejected depth is
  greedy   the retrieval tier's runner-up token there: taken when it is the target's choice;
  sampled  a second draw from the retrieval tier's distribution q without the rejected draft d
           (r = q minus d, renormalized): taken with probability sum_x min(r(x), p'(x)), p' the
           residual norm(max(p - q, 0)) the verify would sample from (an exact second step of
           speculative sampling: whatever r is, the token that comes out follows p').
A taken alternative adds one token (its own row gives the next). The mean over rejections is the
`hit` of offload.cost_model.static_tree_part; the script prints it and the cost model's rows with
it (bench/offload_predictions.py --tree-hit)."""
from __future__ import annotations

import json
import platform
import sys
import time

import click
import torch

from triforce.app.texts import prompt_text
from triforce.config import SamplingParams, SpecParams
import triforce.decoding.engine as engine_module
from triforce.decoding.acceptance_trace import load_trace
from triforce.decoding.engine import Engine
from triforce.model.loading import load_model

SPEC = SpecParams(method="triforce", budget=1024, gamma1=4, gamma2=8)


def second_draw_taken(q: torch.Tensor, p: torch.Tensor, rejected: int) -> float:
    """P(an alternative drawn from q without `rejected` passes the second speculative step)."""
    q, p = q.double(), p.double()
    residual = (p - q).clamp_min(0)
    if residual.sum() <= 0:
        return 0.0
    residual /= residual.sum()
    r = q.clone()
    r[rejected] = 0
    if r.sum() <= 0:
        return 0.0
    r /= r.sum()
    return float(torch.minimum(r, residual).sum())


class Watch:
    """One engine's full verifies, looked at as they happen: for each rejection, how likely the
    alternative beside the rejected draft would have been taken."""

    def __init__(self, engine: Engine):
        self.engine, self.top2, self.taken, self.off_top = engine, {}, [], 0
        self._pending = None
        retrieval, full = engine.levels[-2], engine.full
        real_logits, real_verify, real_verdict = retrieval.logits, full.verify, engine.sampled_verdict

        def logits(seq):
            out = real_logits(seq)
            start = len(seq) - out.shape[0]
            for row, pair in enumerate(out.float().topk(2, dim=-1).indices.tolist()):
                self.top2[start + row + 1] = pair  # the row at position i proposes token i + 1
            return out

        def verify(seq, *args, **kwargs):
            self._pending = (len(seq), dict(self.top2))  # what the retrieval tier proposed for these drafts
            return real_verify(seq, *args, **kwargs)

        def sampled_verdict(tier_name, drafts, dists, probs):
            verdict = real_verdict(tier_name, drafts, dists, probs)
            if tier_name == full.name and verdict.accepted < len(drafts):
                j, q = verdict.accepted, dists[verdict.accepted]
                self.taken.append(0.0 if q is None else second_draw_taken(q, probs[j], drafts[j]))
            return verdict

        retrieval.logits, full.verify, engine.sampled_verdict = logits, verify, sampled_verdict

    def greedy(self, drafts: list[int], verdict) -> None:
        """A greedy verdict; the full tier's when a full verify ran just before it."""
        if self._pending is None:
            return
        length, top2 = self._pending
        self._pending = None
        base = length - len(drafts)
        self.off_top += sum(top2.get(base + i, [None])[0] != d for i, d in enumerate(drafts))
        if verdict.accepted < len(drafts):
            runner_up = top2.get(base + verdict.accepted, [None, None])[1]
            self.taken.append(1.0 if runner_up == verdict.token else 0.0)


def run(lm, ids: list[int], new_tokens: int, temperature: float, cache) -> tuple[dict, object]:
    engine = Engine(lm, SPEC, len(ids) + new_tokens + 1, "lookup", kv_cache=cache)
    if cache is not None:
        engine.full.adopt(ids[:-1])
    engine.set_sequence(ids)
    watch = Watch(engine)
    real_greedy = engine_module.verify_greedy

    def verify_greedy(drafts, rows):
        verdict = real_greedy(drafts, rows)
        watch.greedy(drafts, verdict)
        return verdict

    engine_module.verify_greedy = verify_greedy
    try:
        params = SamplingParams(temperature=temperature, seed=1)
        result = engine.generate(new_tokens, params, frozenset(), generator=torch.Generator().manual_seed(1))
    finally:
        engine_module.verify_greedy = real_greedy
    verifies = sum(1 for r in engine.rounds if r[0] == engine.full.name)
    taken = watch.taken
    return {"temperature": temperature, "full_verifies": verifies, "rejections": len(taken),
            "hit": round(sum(taken) / len(taken), 3) if taken else None,
            "tokens_per_full_verify": round(len(result.tokens) / max(verifies, 1), 3),
            "with_tree": round((len(result.tokens) + sum(taken)) / max(verifies, 1), 3),
            "drafts_not_the_retrieval_top_token": watch.off_top if temperature == 0 else None}, engine.full.cache


@click.command()
@click.option("--prompt-tokens", type=int, default=8000, show_default=True)
@click.option("--new-tokens", type=int, default=192, show_default=True)
@click.option("--temperatures", default="0,0.7", show_default=True)
@click.option("--trace", "trace_path", default="bench/traces/smollm2-natural8k-triforce-lookup.json",
              show_default=True, help="Acceptance trace of the cost model's rows (bench/offload_predictions.py).")
def main(prompt_tokens: int, new_tokens: int, temperatures: str, trace_path: str) -> None:
    """Measure the static tree's hit rate and print the cost model's rows with it."""
    from triforce.bench.offload_predictions import CONTEXTS, PROFILES, predict
    from triforce.kernels.cpu import warm

    lm = load_model("default", dtype="float32", device="cpu")
    warm.warm_up(lm.dtype, [(lm.config.num_kv_heads, lm.config.head_dim)])
    ids = lm.tokenizer(prompt_text("natural", lm.tokenizer, prompt_tokens)).input_ids[:prompt_tokens]
    started, cache, rows = time.perf_counter(), None, []
    for temperature in (float(t) for t in temperatures.split(",")):
        row, cache = run(lm, ids, new_tokens, temperature, cache)
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
    trace = load_trace(trace_path)
    predictions = {f"T={r['temperature']}": [
        {"profile": p["profile"], "context": p["context"], "ms_per_token": p["ms_per_token"]}
        for p in (predict(name, budget, context, trace, r["hit"] or 0.0) for name, budget in PROFILES
                  for context in CONTEXTS)] for r in rows}
    print(json.dumps({"machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
                      "prompt_tokens": len(ids), "new_tokens": new_tokens, "spec": [SPEC.budget, SPEC.gamma1, SPEC.gamma2],
                      "seconds": round(time.perf_counter() - started), "rows": rows, "trace": trace_path,
                      "predictions": predictions}, indent=1))


if __name__ == "__main__":
    main()
