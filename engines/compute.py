"""The model side of a worker: prefill and decode steps on requests, with sampling."""
from __future__ import annotations

import torch

from engines.kv.pool import KVPool
from engines.loader import LoadedModel
from engines.config import ModelError
from engines.models.null import NullNet
from engines.grammar import Grammars, Matcher
from engines.grammar_mask import Allowed, MaskMaker
from engines.null_runner import NullRunner
from engines.runner import ModelRunner
from engines.sampler import Sampler
from engines.request import Request, StopChecker
from engines.routed import RoutedExperts, compact, routing_of
from engines.tp.group import TpGroup
from engines.tp.runner import TpRunner


class Compute:
    """Owns the runner and sampler of one worker. A request's cached prefix is
    prompt + output[:-1]; its next input is output[-1] (after prefill samples the first
    token, or the forced token after a recompute)."""

    def __init__(self, model: LoadedModel, pool: KVPool, tp: TpGroup | None = None,
                 routed_experts: bool = False, deterministic: bool = False) -> None:
        """`tp`: the tensor-parallel group whose leader this is (`model` its part).
        `routed_experts`: requests may ask for their routed experts (engines/routed.py;
        --enable-return-routed-experts). `deterministic`: --deterministic, batch-invariant
        numbers (docs/deterministic.md); ModelError where it cannot be had."""
        self.model, self.pool, self.routed_experts = model, pool, routed_experts
        self.deterministic = deterministic
        self.runner = runner_for(model, pool, tp, deterministic)
        eos = () if model.cfg.eos_token_ids is None else tuple(model.cfg.eos_token_ids)
        self.sampler = Sampler(eos, self.runner.backend.argmax)
        self.stop = StopChecker(eos, model.tokenizer)
        self.eos = set(eos)
        self.grammars = Grammars(model.tokenizer, model.cfg.vocab_size, eos)
        self._masks: MaskMaker | None = None      # made for the first constrained request

    def prefill(self, reqs: list[Request], starts: list[int] | None = None) -> None:
        """Write the KV of each cached prefix (from position starts[i] on: what comes
        before is in the request's pages already); sample a first token for fresh
        requests (a scoring one, max_new_tokens 0, ends instead), and the prompt logprobs
        of those that ask (their starts must leave the positions those read uncached:
        Request.reusable_prefix)."""
        prefixes = [r.prompt + r.output[:-1] for r in reqs]
        asks = [r.prompt_logprob_ask for r in reqs]
        routing = routing_of([r.params.routing for r in reqs])
        logits, got = self.runner.prefill_with_logprobs(prefixes, [r.pages for r in reqs], starts,
                                                        asks if any(asks) else None, routing)
        for r, g in zip(reqs, got):
            r.prompt_logprobs = g if g is not None else r.prompt_logprobs
        if self.runner.routed is not None:
            self._keep_prompt_routing(reqs, [len(p) for p in prefixes], starts or [0] * len(reqs))
        fresh = [i for i, r in enumerate(reqs) if not r.output and not r.params.scores_only]
        for r in reqs:
            if r.params.scores_only:             # scored: it ends here, with no output token
                r.finish, r.scored_version = {"type": "length"}, self.model.version
        if fresh:
            self._sample(logits[fresh], [reqs[i] for i in fresh])
        self.pool.synchronize()     # the KV is complete before a transfer engine reads it

    def _keep_prompt_routing(self, reqs: list[Request], lens: list[int], starts: list[int]) -> None:
        """Each asking request's routed experts: its computed prefix's rows, all of them
        (a recompute's replace the ones before, under the weights of now)."""
        got, at = self.runner.routed.host(), 0
        for r, n, s in zip(reqs, lens, starts):
            if r.params.routing is not None:
                if s:        # Request.reusable_prefix keeps such a request off the cache
                    raise ValueError(f"rid {r.rid!r}: its routed experts start at position 0, "
                                     f"not at its cached prefix's end {s}")
                w = got.weights[at:at + n] if r.params.routing == "weights" else None
                r.routed = RoutedExperts(compact(got.ids[at:at + n], self.model.cfg),
                                         None if w is None else w.clone())
            at += n - s

    def decode(self, reqs: list[Request]) -> None:
        routing = routing_of([r.params.routing for r in reqs])
        logits = self.runner.decode([r.output[-1] for r in reqs], [r.context_len - 1 for r in reqs],
                                    [r.pages for r in reqs], routing)
        got = None if self.runner.routed is None else self.runner.routed.host()
        if got is not None:
            ids = compact(got.ids, self.model.cfg)          # one copy for the batch
            for i, r in enumerate(reqs):
                if r.params.routing is not None and r.routed is not None:
                    w = got.weights[i:i + 1] if r.params.routing == "weights" else None
                    r.routed.append(ids[i:i + 1].clone(), None if w is None else w.clone())
        self._sample(logits, reqs)

    def _sample(self, logits, reqs: list[Request]) -> None:
        got = self.sampler.sample(logits, [r.params for r in reqs], [r.seed for r in reqs],
                                  [len(r.output) for r in reqs], [r.prompt for r in reqs],
                                  [r.output for r in reqs], self._allowed(reqs, logits.device))
        for r, t, lp, top, ids in zip(reqs, got.tokens, got.logprobs, got.top, got.ids):
            r.emit(t, self.model.version, lp, top, ids)
            r.finish = self.finished(r)

    def finished(self, r: Request) -> dict | None:
        """How `r` ends after its latest token (None: it goes on). A constrained one
        ends when its grammar is complete and it draws an end token, even before its
        min_new_tokens or with ignore_eos (nothing else may follow); a token that breaks
        its grammar (none it sampled: a peer's) ends it with status 500."""
        m = self.matcher(r)
        if m is not None and not m.follow(r.output):
            return {"type": "abort", "status_code": 500, "message": m.problem}
        if m is not None and m.ended and r.output[-1] in self.eos:
            return {"type": "stop", "matched": r.output[-1]}
        return self.stop(r)

    def matcher(self, r: Request) -> Matcher | None:
        """The request's grammar matcher (built, and following its output so far, on first
        use: in a decode, after the prefill's first token or a retraction); None when
        it has no constraint. ValueError: its grammar does not compile."""
        c = r.params.constraint
        if c is not None and r.grammar is None:
            r.grammar = self.grammars.matcher(c)
        return r.grammar

    def _allowed(self, reqs: list[Request], device: torch.device) -> Allowed | None:
        if not any(r.params.constraint for r in reqs):
            return None
        matchers = [self.matcher(r) for r in reqs]
        for r, m in zip(reqs, matchers):
            if m is not None:
                m.follow(r.output)
        if self._masks is None:
            self._masks = MaskMaker(self.model.cfg.vocab_size)
        return self._masks(matchers, device)


def runner_for(model: LoadedModel, pool: KVPool, tp: TpGroup | None = None,
               deterministic: bool = False):
    """The runner of `model`: the null model's (engines/null_runner.py), else the network's,
    across the tensor-parallel group `tp` if there is one."""
    if isinstance(model.net, NullNet):
        if tp is not None:
            raise ModelError("the null model runs at --tp 1 only")
        return NullRunner(model, pool)
    if deterministic and tp is not None:
        raise ModelError("--deterministic runs at --tp 1 and --ep 1 for now (docs/deterministic.md)")
    return ModelRunner(model, pool, deterministic=deterministic) if tp is None else TpRunner(model, pool, tp)
