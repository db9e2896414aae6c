"""The batched engine (kdtree.engine.batched): request slots, continuous batching, the
kdtree attention over a per-slot static cache, and (on a GPU) one CUDA graph a round.

The reference is independent of the engine: greedy autoregressive decoding of the same
transformers model through :class:`kdtree.hf.HFTarget` (transformers' DynamicCache, its
own SDPA attention, one sequence at a time). In float32 the engine's DDTree output must
equal it token for token for every prompt, budget and batch size, also when finished
requests' slots are refilled from the queue and prompts are prefilled in chunks.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (nox -s test installs it)")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import kdtree  # noqa: E402
from kdtree.engine import autoregressive_generate  # noqa: E402
from kdtree.engine.batched import Engine, SamplingParams  # noqa: E402
from kdtree.engine.dflash import load_dflash  # noqa: E402
from kdtree.engine.drafter import BlockDrafter, BlockDrafterConfig  # noqa: E402
from kdtree.engine.hf import HFTarget, load_causal_lm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "fixtures" / "models" / "stdlib-qwen3"
NEW = 24


def shipped_prompts(n: int) -> list[list[int]]:
    """n prompts of 20 .. 150 tokens: slices of kdtree's own sources (held-out text)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(PAIR / "tokenizer.json"))
    texts = []
    for f in sorted((ROOT / "python" / "kdtree").rglob("*.py")):
        t = f.read_text()
        if len(t) > 3000:
            texts.append(t)
    out = []
    for i in range(n):
        t = texts[i % len(texts)]
        start = 500 + 97 * i
        ids = tok.encode(t[start:start + 80 + 41 * (i % 12)]).ids
        out.append(ids[: 20 + 13 * (i % 11)])
    return out


def reference(model, prompts, new: int, stop_tokens=()) -> list[list[int]]:
    target = HFTarget(model)
    return [autoregressive_generate(target, p, new, stop_tokens=stop_tokens).tokens for p in prompts]


@pytest.fixture(scope="module")
def pair():
    target = load_causal_lm(PAIR / "target", dtype="float32")
    drafter = load_dflash(PAIR / "drafter", target)
    return target, drafter


@pytest.fixture(scope="module")
def prompts():
    return shipped_prompts(20)


@pytest.fixture(scope="module")
def expected(prompts):
    model = load_causal_lm(PAIR / "target", dtype="float32")  # a model the engine never attaches to
    return reference(model, prompts, NEW)


@pytest.mark.parametrize("budget", [1, 16, 64])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_autoregressive(pair, prompts, expected, budget, batch):
    target, drafter = pair
    eng = Engine(target, drafter, max_batch=batch, budget=budget, max_length=512, prefill_chunk=48)
    outs = eng.generate(prompts, NEW)
    for i, (o, want) in enumerate(zip(outs, expected, strict=True)):
        assert o.tokens == want, f"prompt {i} ({len(prompts[i])} tokens), budget {budget}, batch {batch}"
        assert o.finish_reason == "max_new_tokens"
        assert sum(o.committed) == NEW
    if budget >= 16:  # the shipped drafter is good: far fewer rounds than tokens
        assert eng.stats.acceptance_length > 2.0, eng.stats
    assert eng.stats.prefill_chunks > len(prompts)  # prompts longer than 48 tokens took several chunks


def test_chain_and_ar_modes(pair, prompts, expected):
    target, drafter = pair
    for mode in ("chain", "ar"):
        eng = Engine(target, drafter, max_batch=4, mode=mode, max_length=512)
        outs = eng.generate(prompts[:8], NEW)
        assert [o.tokens for o in outs] == expected[:8], mode
        if mode == "ar":
            assert eng.stats.acceptance_length == 1.0
            assert eng.stats.tokens == eng.stats.slot_rounds  # one token a request a forward
            assert eng.stats.target_rows <= 4 * eng.stats.rounds  # one row a slot


def test_stop_token_inside_accepted_path(pair, prompts, expected):
    target, drafter = pair
    # a token the reference emits after at least 3 tokens: the engine must stop right after it,
    # although DDTree accepts several tokens a round (so the stop is mid-path)
    cases = [(i, want[k]) for i, want in enumerate(expected) for k in range(3, NEW) if want[k] not in want[:k]][:6]
    assert cases
    for i, stop in cases:
        eng = Engine(target, drafter, max_batch=2, budget=32, max_length=512, stop_tokens=[stop])
        out = eng.generate([prompts[i]], NEW)[0]
        want = expected[i][: expected[i].index(stop) + 1]
        assert out.tokens == want
        assert out.finish_reason == "stop_token"


def _stop_sequence_cases(prompts, expected, committed):
    """(prompt index, sequence, the reference's tokens up to it) for prompts 0 .. 3: two-token
    sequences that first complete at a token k >= 2 of the greedy output, one inside a round
    and one across a round boundary (token k - 1 the last of a round, the next tree's root)
    where the rounds (``committed``: tokens a round, from a run without stops) allow; and one
    that begins in the prompt (its last token, then the first generated one)."""
    cases = []
    for i in range(4):
        want, stream0 = expected[i], prompts[i]
        ends = set(np.cumsum(committed[i]) - 1)  # output indices that end a round
        for across in (False, True):
            for k in range(2, len(want)):
                if ((k - 1) in ends) != across:
                    continue
                q = [want[k - 1], want[k]]
                stream = stream0 + want[: k + 1]
                first = next(j for j in range(1, len(stream)) if stream[j - 1:j + 1] == q)
                if first == len(stream0) + k:  # completes here first
                    cases.append((i, q, want[: k + 1]))
                    break
    i = next(i for i, want in enumerate(expected) if [prompts[i][-1], want[0]] not in
             ([prompts[i][j - 1], prompts[i][j]] for j in range(1, len(prompts[i]))))
    cases.append((i, [prompts[i][-1], expected[i][0]], expected[i][:1]))
    return cases


@pytest.mark.parametrize("mode", ["ddtree", "chain", "ar"])
def test_stop_sequences_end_requests_where_autoregressive_decoding_does(pair, prompts, expected, mode):
    """Each case alone in an engine (its sequence plus a 16-token one that never completes):
    the output ends where greedy autoregressive decoding with that sequence ends."""
    target, drafter = pair
    kw = dict(max_batch=4, budget=32, mode=mode, max_length=512)
    plain = Engine(target, drafter, **kw).generate(prompts[:4], NEW)
    assert [o.tokens for o in plain] == expected[:4]
    cases = _stop_sequence_cases(prompts, expected, [o.committed for o in plain])
    assert len(cases) >= 5  # across round boundaries (AR: every one), inside rounds, from the prompt
    ref = load_causal_lm(PAIR / "target", dtype="float32")
    never = list(range(1, 17))
    for i, q, want in cases:
        eng = Engine(target, drafter, stop_sequences=[q, never], **kw)
        out = eng.generate([prompts[i]], NEW)[0]
        ar = autoregressive_generate(HFTarget(ref), prompts[i], NEW, stop_sequences=[q, never])
        assert ar.tokens == want and ar.stop_reason == "stop_sequence"
        assert out.tokens == want, (mode, i, q)
        assert out.finish_reason == "stop_sequence"


@pytest.mark.parametrize("mode", ["ddtree", "ar"])
def test_per_request_stops_end_each_request_where_autoregressive_decoding_does(pair, prompts, expected, mode):
    """Requests with their own stop tokens and sequences (SamplingParams) in one batch, next
    to one without: each output ends where greedy autoregressive decoding with that
    request's stops ends; the stops of one request do not touch another."""
    target, drafter = pair
    kw = dict(max_batch=4, budget=32, mode=mode, max_length=512)
    plain = Engine(target, drafter, **kw).generate(prompts[:4], NEW)
    seq_cases = _stop_sequence_cases(prompts, expected, [o.committed for o in plain])
    token_cases = [(i, want[k]) for i, want in enumerate(expected[:8]) for k in range(3, NEW)
                   if want[k] not in want[:k]]
    requests = []  # (prompt index, SamplingParams, AR stop_tokens, AR stop_sequences)
    for i, stop in token_cases[:3]:
        requests.append((i, SamplingParams(stop_token_ids=[stop, 0]), [stop, 0], None))
    for i, q, _ in seq_cases[:3]:
        requests.append((i, SamplingParams(stop_sequences=[q, list(range(1, 17))]), (), [q, list(range(1, 17))]))
    requests.append((5, SamplingParams(), (), None))
    ref = load_causal_lm(PAIR / "target", dtype="float32")
    eng = Engine(target, drafter, **kw)
    outs = eng.generate([prompts[i] for i, *_ in requests], NEW, sampling=[sp for _, sp, _, _ in requests])
    ends = set()
    for (i, sp, stops, seqs), out in zip(requests, outs, strict=True):
        ar = autoregressive_generate(HFTarget(ref), prompts[i], NEW, stop_tokens=stops, stop_sequences=seqs)
        assert out.tokens == ar.tokens, (mode, i, sp)
        assert out.finish_reason == ar.stop_reason, (mode, i, sp)
        assert sum(out.committed) == len(out.tokens)
        ends.add(out.finish_reason)
    assert ends == {"stop_token", "stop_sequence", "max_new_tokens"}
    assert outs[-1].tokens == expected[5]


def test_per_request_stops_are_checked(pair):
    target, drafter = pair
    for kw, match in ((dict(stop_token_ids="ab"), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
                      (dict(stop_token_ids=[True]), "stop_token_ids"), (dict(stop_token_ids=5), "stop_token_ids"),
                      (dict(stop_token_ids=[2**31]), "stop_token_ids"), (dict(stop_sequences=[[]]), "1 to 16"),
                      (dict(stop_sequences=[list(range(17))]), "1 to 16"), (dict(stop_sequences=[[-1]]), "negative"),
                      (dict(stop_sequences="ab"), "sequence of token sequences")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    sp = SamplingParams(stop_token_ids=iter([4, 2]), stop_sequences=(q for q in [[5, 6], [7]]))
    assert sp.stop_token_ids == (4, 2) and sp.stop_sequences == ((5, 6), (7,))
    eng = Engine(target, drafter, max_batch=1, budget=4, max_length=64)
    vocab = eng.vocab_size
    with pytest.raises(ValueError, match=f"token {vocab} outside"):
        eng.submit([1, 2], 4, SamplingParams(stop_token_ids=[vocab]))
    with pytest.raises(ValueError, match=r"stop_sequences\[1\] holds a token outside"):
        eng.submit([1, 2], 4, SamplingParams(stop_sequences=[[3], [1, vocab]]))
    assert not eng.busy


def test_stop_sequences_are_checked(pair):
    target, drafter = pair
    for bad, match in (([[]], "1 to 16"), ([list(range(17))], "1 to 16"), ([[-1]], "negative"),
                       ([[5, 99999]], "outside \\[0, "), ("ab", "sequence of token sequences")):
        with pytest.raises(ValueError, match=match):
            Engine(target, drafter, max_batch=1, budget=4, max_length=64, stop_sequences=bad)
    # an iterator is read once, and kept
    eng = Engine(target, drafter, max_batch=1, budget=4, max_length=64, stop_sequences=(q for q in [[5, 6], [7]]))
    assert eng.stop_sequences == ((5, 6), (7,))
    eng = Engine(target, drafter, max_batch=1, budget=4, max_length=64, stop_tokens=iter([9, 3]))
    assert eng.stop_tokens == {3, 9} and eng.state.stops.tolist() == [3, 9]


def test_max_new_tokens_inside_accepted_path(pair, prompts, expected):
    target, drafter = pair
    eng = Engine(target, drafter, max_batch=4, budget=64, max_length=512)
    for n in (1, 2, 5, 7):
        outs = eng.generate(prompts[:4], n)
        assert [o.tokens for o in outs] == [e[:n] for e in expected[:4]]
        assert all(o.finish_reason == "max_new_tokens" for o in outs)
    assert eng.generate(prompts[:1], 0)[0].tokens == []


def test_position_limit(pair, prompts, expected):
    target, drafter = pair
    p = prompts[3]
    eng = Engine(target, drafter, max_batch=1, budget=16, max_length=len(p) + 5)
    out = eng.generate([p], NEW)[0]
    assert out.tokens == expected[3][:5]
    assert out.finish_reason == "length"


def test_submit_and_step(pair, prompts, expected):
    """Requests submitted while others decode are admitted between rounds."""
    target, drafter = pair
    eng = Engine(target, drafter, max_batch=2, budget=16, max_length=512)
    ids = [eng.submit(prompts[0], NEW)]
    eng.step()
    eng.step()
    ids += [eng.submit(p, NEW) for p in prompts[1:5]]
    while eng.busy:
        eng.step()
    assert [eng.output(i).tokens for i in ids] == expected[:5]


def test_abort_and_release(pair, prompts, expected):
    """abort() ends a decoding, a prefilling and a queued request at once (tokens so far
    kept, "aborted"); the others still decode to autoregressive decoding's outputs in the
    freed slots; release() hands back finished outputs only and forgets them."""
    _abort_and_release(*pair, prompts, expected)


def _abort_and_release(target, drafter, prompts, expected):
    eng = Engine(target, drafter, max_batch=2, budget=16, max_length=512, prefill_chunk=16)
    if eng.use_graphs:
        eng.capture_all()
    long = max(range(len(prompts)), key=lambda i: len(prompts[i]))  # prefilled over several steps
    order = [0, long, 1, 2, 3]
    ids = [eng.submit(prompts[i], NEW) for i in order]
    eng.step()
    while len(eng.output(ids[0]).tokens) < 3:  # request 0 decodes; the long one is still prefilling
        eng.step()
    assert not eng.output(ids[1]).tokens and not eng.output(ids[1]).finished
    assert [r.out.request_id for r in eng._prefilling] == [ids[1]] and len(prompts[long]) > 3 * 16
    assert eng.abort(ids[0]) and eng.abort(ids[1]) and eng.abort(ids[3])  # decoding, prefilling, queued
    kept = list(eng.output(ids[0]).tokens)
    with pytest.raises(ValueError, match="has not finished"):
        eng.release(ids[2])
    while eng.busy:
        eng.step()
    outs = {i: eng.output(i) for i in ids}
    assert [outs[ids[k]].finish_reason for k in range(5)] == ["aborted", "aborted", "max_new_tokens", "aborted",
                                                               "max_new_tokens"]
    assert outs[ids[0]].tokens == kept and 3 <= len(kept) < NEW and kept == expected[0][:len(kept)]
    assert outs[ids[1]].tokens == [] and outs[ids[3]].tokens == []
    assert outs[ids[2]].tokens == expected[1] and outs[ids[4]].tokens == expected[3]
    assert eng.abort(ids[2]) is False  # already finished: nothing changes
    assert eng.release(ids[2]) is outs[ids[2]]
    for call in (eng.output, eng.abort, eng.release):
        with pytest.raises(KeyError, match="released"):
            call(ids[2])
    # generate() hands its outputs over: the engine keeps none
    outs = eng.generate(prompts[5:7], 4)
    with pytest.raises(KeyError):
        eng.output(outs[0].request_id)


@pytest.mark.parametrize("mode", ["ddtree", "ar"])
def test_a_request_with_nan_activations_fails_alone_and_leaves_its_slot_clean(prompts, expected, mode):
    """A token whose embedding is NaN: the request that holds it ends with "error" while the
    other decodes on; the slot it held is cleared (masked cache rows holding NaN would
    otherwise make every later request there NaN), so later requests decode as in a fresh
    engine."""
    _nan_request(prompts, expected, mode, "cpu")


def _nan_request(prompts, expected, mode, device):
    target = load_causal_lm(PAIR / "target", device=device, dtype="float32")
    drafter = load_dflash(PAIR / "drafter", target)
    used = set().union(*map(set, prompts[:3]), *map(set, expected[:3]))
    bad = next(t for t in range(100, 5000) if t not in used)

    def nan_at_bad(module, args, out):  # (not the weights: this target's LM head is its embedding)
        return out.masked_fill((args[0] == bad)[..., None], float("nan"))

    target.get_input_embeddings().register_forward_hook(nan_at_bad)
    eng = Engine(target, drafter, max_batch=2, budget=16, max_length=512, mode=mode)
    first = eng.generate([prompts[0] + [bad, 7], prompts[1]], NEW)
    assert first[0].finish_reason == "error" and "KDT_ERR_VALUE" in first[0].error
    assert first[1].tokens == expected[1] and first[1].finish_reason == "max_new_tokens"
    again = eng.generate([prompts[2], prompts[0]], NEW)  # prompts[2] takes the failed request's slot
    assert [o.tokens for o in again] == [expected[2], expected[0]]


def test_callbacks_run_after_the_round_and_cannot_break_it(pair, prompts, expected):
    """on_tokens runs once the whole round is read: one that raises comes out of step()
    after the other requests' tokens are in (none dropped, none stuck), one that aborts
    its own finished request changes nothing, a non-callable is refused at submit, and a
    SamplingParams changed after submit has no effect (the request keeps its own copy)."""
    target, drafter = pair
    eng = Engine(target, drafter, max_batch=2, budget=16, max_length=512)
    calls = []

    def flaky(count):
        calls.append(count)
        if len(calls) == 2:
            raise RuntimeError("a caller's bug")

    a = eng.submit(prompts[0], NEW, on_tokens=flaky)
    b = eng.submit(prompts[1], NEW)
    raised = 0
    while eng.busy:
        try:
            eng.step()
        except RuntimeError:
            raised += 1
    assert raised == 1 and sum(calls) == NEW
    assert eng.output(a).tokens == expected[0] and eng.output(b).tokens == expected[1]
    assert eng.output(a).finish_reason == eng.output(b).finish_reason == "max_new_tokens"
    # a request that aborts itself from its callback when its last round is read: already finished
    got = []
    c = eng.submit(prompts[2], 4, on_tokens=lambda n: got.append(eng.abort(c)) if len(eng.output(c).tokens) == 4
                   else None)
    while eng.busy:
        eng.step()
    assert got[-1] is False and eng.output(c).finish_reason == "max_new_tokens" and eng.output(c).tokens == \
        expected[2][:4]
    with pytest.raises(TypeError, match="on_tokens must be a callable"):
        eng.submit(prompts[0], 4, on_tokens=5)
    sp = SamplingParams()
    d = eng.submit(prompts[3], 8, sp)
    sp.stop_token_ids = (expected[3][0],)  # after submit: not the request's any more
    bad = SamplingParams()
    bad.stop_token_ids = [-3]  # changed after it was built: checked again at submit
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.submit(prompts[3], 8, bad)
    while eng.busy:
        eng.step()
    assert eng.output(d).tokens == expected[3][:8]
    with pytest.raises(TypeError, match="request_id must be an int"):
        eng.output(True)
    with pytest.raises(ValueError, match="holds a bool"):
        SamplingParams(stop_sequences=[[True, 2]])
    with pytest.raises(kdtree.KdtreeTypeError, match="holds a bool"):
        kdtree.stop_sequences([np.array([1, 0], bool)])


def test_bad_input(pair):
    target, drafter = pair
    eng = Engine(target, drafter, max_batch=1, budget=4, max_length=64)
    with pytest.raises(ValueError, match="at least one token"):
        eng.submit([], 4)
    v = target.config.vocab_size
    with pytest.raises(ValueError, match=f"prompt element 1: token {v} outside"):
        eng.submit([1, v], 4)
    with pytest.raises(ValueError, match="max_length is 64"):
        eng.submit([1] * 64, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.submit([1], -1)
    with pytest.raises(ValueError, match="sampling=True"):
        eng.submit([1], 4, SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="mode"):
        Engine(target, drafter, mode="tree")
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(target, None)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(target, drafter, max_length=10**6)
    other = BlockDrafter(BlockDrafterConfig(vocab_size=target.config.vocab_size, feature_size=512,
                                            target_layers=(1, 2, 3)))
    with pytest.raises(ValueError, match="feature_size 512"):
        Engine(target, other)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    # values the engine's float32 / int32 device arrays cannot hold are refused up front
    for bad in (dict(temperature=1e300), dict(temperature=1.0, top_p=1e-300), dict(temperature=1.0, top_k=2**31)):
        with pytest.raises(ValueError, match="float32|2\\*\\*31"):
            SamplingParams(**bad)
    SamplingParams(temperature=3.4e38, top_p=1.2e-38, top_k=2**31 - 1)  # the largest that fit
    with pytest.raises(ValueError, match="stop_tokens"):
        Engine(target, drafter, stop_tokens=5)
    with pytest.raises(ValueError, match="auto_budgets"):
        Engine(target, drafter, budget="auto", auto_budgets=[1.7, 8])
    with pytest.raises(ValueError, match=r"auto_budgets must be integers in \[1, 4096\]"):
        Engine(target, drafter, budget="auto", auto_budgets=[8, 10**30])
    with pytest.raises(ValueError, match="tree_attention must be"):
        Engine(target, drafter, tree_attention="flash")
    with pytest.raises(ValueError, match="tree_attention='kdtree': the kernel runs on CUDA devices"):
        Engine(target, drafter, tree_attention="kdtree")
    assert Engine(target, drafter, max_batch=1, budget=4, max_length=64).tree_attention == "sdpa"
    import copy

    with pytest.raises(ValueError, match="float64, the target torch.float32"):
        Engine(target, copy.deepcopy(drafter).double())
    with pytest.raises(TypeError, match="loaded target model"):
        load_dflash(PAIR / "drafter", None)


def test_cache_larger_than_free_memory_is_refused(pair, monkeypatch):
    """A K/V cache that cannot fit the device's free memory is refused before allocating,
    naming the size: 6 layers x 2 x 5 KV heads x 64 x 4 bytes = 15,360 bytes a row."""
    from kdtree.engine import batched

    target, drafter = pair
    monkeypatch.setattr(batched, "_free_bytes", lambda torch, device: 15_360 * 100)
    Engine(target, drafter, max_batch=1, budget=4, max_length=95)  # 100 rows: fits exactly
    with pytest.raises(ValueError, match=r"needs 0.00 GiB \(max_batch 2 x 100 rows"):
        Engine(target, drafter, max_batch=2, budget=4, max_length=95)


def test_a_dropped_engines_cache_is_freed(pair, prompts, expected):
    """The model keeps no reference to a dropped engine's K/V cache once another engine is
    built on it, and an engine still in use keeps decoding the same tokens after another
    one was built on the same model."""
    import gc
    import weakref

    target, drafter = pair
    first = Engine(target, drafter, max_batch=2, budget=8, max_length=256)
    gone = weakref.ref(first.kv.keys[0])
    del first
    kept = Engine(target, drafter, max_batch=2, budget=8, max_length=256)
    gc.collect()
    assert gone() is None
    Engine(target, drafter, max_batch=1, budget=4, max_length=128)  # unbinds kept's cache from the model
    assert [o.tokens for o in kept.generate(prompts[:2], 16)] == [e[:16] for e in expected[:2]]


def tiny(family: str, seed: int = 0):
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=8, **common)
        cls = transformers.Qwen3ForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.LlamaConfig(head_dim=8, **common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float64).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(25.0)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_model_families(family):
    """Each family through transformers' own classes with the kdtree attention, in float64:
    DDTree output equals the family's own greedy decoding (a random drafter: the trees are
    mostly rejected, which exercises every walk length)."""
    model = tiny(family)
    ref_model = tiny(family)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (int(n),), generator=g).tolist() for n in (1, 2, 9, 17, 33, 5)]
    want = reference(ref_model, prompts, 12)
    cfg = BlockDrafterConfig(vocab_size=97, feature_size=64, target_layers=(1, 2), hidden_size=32, num_layers=1,
                             num_heads=2, head_dim=16, intermediate_size=64, block_size=5)
    torch.manual_seed(2)
    drafter = BlockDrafter(cfg).to(torch.float64).eval()
    for mode, budget in (("ar", 0), ("chain", 0), ("ddtree", 8)):
        eng = Engine(model, drafter, max_batch=4, budget=budget, mode=mode, max_length=64, prefill_chunk=8)
        assert [o.tokens for o in eng.generate(prompts, 12)] == want, (family, mode)


# ---- GPU: the same checks with CUDA graphs ------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device (these tests need a GPU)")


@pytest.fixture(scope="module")
def gpu_pair():
    target = load_causal_lm(PAIR / "target", device="cuda", dtype="float32")
    drafter = load_dflash(PAIR / "drafter", target)
    return target, drafter


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("budget", [1, 16, 64])
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_graph_greedy_equals_autoregressive(gpu_pair, prompts, expected, budget, batch):
    target, drafter = gpu_pair
    eng = Engine(target, drafter, max_batch=batch, budget=budget, max_length=512, prefill_chunk=48)
    assert eng.use_graphs
    eng.capture_all(prefill=batch > 1)  # prefill graphs captured up front (padding inputs) or on first use
    outs = eng.generate(prompts, NEW)
    bad = [i for i, (o, e) in enumerate(zip(outs, expected, strict=True)) if o.tokens != e]
    assert not bad, f"prompts {bad} differ from autoregressive decoding (budget {budget}, batch {batch})"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_gpu_generate_captures_itself(gpu_pair, prompts, expected, mode):
    """generate() on a fresh graph engine captures its round graphs before admitting any
    request (no capture_all() by the caller), in every mode."""
    target, drafter = gpu_pair
    eng = Engine(target, drafter, max_batch=4, mode=mode, max_length=512)
    outs = eng.generate(prompts[:6], NEW)
    assert [o.tokens for o in outs] == expected[:6]
    assert eng.generate(prompts[6:8], NEW)[1].tokens == expected[7]  # a second call keeps the graphs


@gpu
@pytest.mark.gpu
def test_gpu_tree_attention_kernel_in_the_verify_forward(prompts):
    """In bfloat16 the verify forward runs kdtree's tree-attention kernel by default; its
    text stays the SDPA path's but for bfloat16 near-ties (the two sum in different orders),
    and the kernel's float32 statuses stay clean (no request fails)."""
    target = load_causal_lm(PAIR / "target", device="cuda", dtype="bfloat16")
    drafter = load_dflash(PAIR / "drafter", target)
    runs = {}
    for how in ("kdtree", "sdpa"):
        eng = Engine(target, drafter, max_batch=4, budget=32, max_length=512, tree_attention=how)
        assert eng.tree_attention == how
        outs = eng.generate(prompts[:12], NEW)
        assert all(o.finish_reason != "error" for o in outs), [o.error for o in outs]
        runs[how] = [o.tokens for o in outs]
    assert Engine(target, drafter, max_batch=1, budget=4, max_length=64).tree_attention == "kdtree"
    same = sum(a == b for a, b in zip(runs["kdtree"], runs["sdpa"], strict=True))
    assert same >= 9, f"only {same} of 12 outputs equal the SDPA path's"


@gpu
@pytest.mark.gpu
def test_gpu_graph_equals_eager(gpu_pair, prompts):
    target, drafter = gpu_pair
    runs = []
    for graphs in (False, True):
        eng = Engine(target, drafter, max_batch=4, budget=32, max_length=512, use_graphs=graphs)
        eng.capture_all()
        outs = eng.generate(prompts[:12], NEW)
        runs.append([(o.tokens, o.committed) for o in outs])
    assert runs[0] == runs[1]


@gpu
@pytest.mark.gpu
def test_gpu_stop_and_caps(gpu_pair, prompts, expected):
    target, drafter = gpu_pair
    i, stop = next((i, e[k]) for i, e in enumerate(expected) for k in range(3, NEW) if e[k] not in e[:k])
    eng = Engine(target, drafter, max_batch=4, budget=64, max_length=512, stop_tokens=[stop])
    eng.capture_all()
    outs = eng.generate(prompts[:8], 6)
    for j, o in enumerate(outs):
        e = expected[j][:6]
        want = e[: e.index(stop) + 1] if stop in e else e
        assert o.tokens == want, j


# ---- sampling: lossless in distribution ----------------------------------------------------


def _chi2_pvalue(counts, probs) -> float:
    """Pearson chi-square p-value of observed ``counts`` against ``probs`` (cells with an
    expected count under 5 are pooled into one)."""
    from math import fsum

    import numpy as np

    n = int(np.sum(counts))
    exp = np.asarray(probs, np.float64) * n
    big = exp >= 5
    obs = np.append(np.asarray(counts, np.float64)[big], np.sum(np.asarray(counts)[~big]))
    exp = np.append(exp[big], n - fsum(exp[big]))
    keep = exp > 0
    stat = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    dof = int(keep.sum()) - 1
    assert dof >= 2, f"too few samples for a chi-square test ({n} draws, {dof} degrees of freedom)"
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _exact_next(model, seq, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([seq], device=model.device)).logits[0, -1].double()
    return torch.softmax(logits / temperature, -1).cpu().numpy()


def _spread_prompt(model, prompts, n):
    """The 40-token cut of a prompt (of the first 20) whose next two tokens suit a
    chi-square test of n draws best: the most categories expected at least 5 times, for the
    first token's distribution and for the second's after the likeliest first token (about
    n x its probability draws), whatever text the prompts were cut from."""
    best, best_score = None, -1
    for p in prompts[:20]:
        p = p[:40]
        p1 = _exact_next(model, p, 1.0)
        p2 = _exact_next(model, p + [int(p1.argmax())], 1.0)
        score = min(int((p1 * n >= 5).sum()), int((p2 * n * p1.max() >= 5).sum()))
        if score > best_score:
            best, best_score = p, score
    assert best_score >= 3, f"no prompt gives a chi-square test categories to count (best {best_score})"
    return best


def _sampling_check(target, drafter, prompt, n, batch, device_model):
    """First and second tokens of n sampled requests (seeds 0 .. n-1, T = 1.0) in modes
    ddtree and ar: each follows the target's exact distribution (chi-square, p > 1e-4)."""
    import numpy as np

    p1 = _exact_next(device_model, prompt, 1.0)
    for mode in ("ddtree", "ar"):
        eng = Engine(target, drafter, max_batch=batch, budget=16, mode=mode, max_length=256, sampling=True)
        eng.capture_all()
        outs = eng.generate([prompt] * n, 2, [SamplingParams(temperature=1.0, seed=i) for i in range(n)])
        first = np.array([o.tokens[0] for o in outs])
        pv = _chi2_pvalue(np.bincount(first, minlength=p1.size), p1)
        assert pv > 1e-4, (mode, "first token", pv)
        top = int(np.bincount(first).argmax())
        second = np.array([o.tokens[1] for o in outs if o.tokens[0] == top])
        assert second.size >= n // 10, (mode, "the most frequent first token is too rare", second.size)
        p2 = _exact_next(device_model, prompt + [top], 1.0)
        pv2 = _chi2_pvalue(np.bincount(second, minlength=p2.size), p2)
        assert pv2 > 1e-4, (mode, "second token", pv2)
        if mode == "ddtree":  # some draft tokens were accepted while sampling (fewer rounds than tokens)
            assert eng.stats.tokens > eng.stats.slot_rounds, eng.stats


def test_sampling_follows_the_target(pair, prompts):
    target, drafter = pair
    ref = load_causal_lm(PAIR / "target", dtype="float32")
    _sampling_check(target, drafter, _spread_prompt(ref, prompts, 400), 400, 16, ref)


def test_sampling_greedy_requests_in_a_sampling_batch(pair, prompts, expected):
    """temperature 0 in a sampling engine is greedy, beside sampled requests."""
    target, drafter = pair
    eng = Engine(target, drafter, max_batch=4, budget=16, max_length=512, sampling=True)
    params = [SamplingParams() if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i)
              for i in range(8)]
    outs = eng.generate(prompts[:8], NEW, params)
    for i in range(0, 8, 2):
        assert outs[i].tokens == expected[i]
    assert all(len(o.tokens) == NEW for o in outs)


@gpu
@pytest.mark.gpu
def test_gpu_sampling_follows_the_target(gpu_pair, prompts):
    """1,000 sampled requests through the graph-captured rounds (the offsets advance inside
    the graph: a replay that reused its draws would fail the chi-square)."""
    target, drafter = gpu_pair
    _sampling_check(target, drafter, _spread_prompt(target, prompts, 1000), 1000, 64, target)


def test_truncated_trees_equal_smaller_builds():
    """budget='auto' builds at the largest budget and takes the first n nodes: that is the
    tree a build at budget n gives (DDTree's nodes come in pop order)."""
    import numpy as np

    import kdtree
    from kdtree.engine.batched import _trees_to_torch, truncate_trees

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 7, 300)).astype(np.float32) * 3
    big = _trees_to_torch(kdtree.build_trees_from_logits(logits, 64, 64, root_tokens=[1, 2, 3, 4, 5],
                                                         root_positions=[0, 3, 9, 1, 2], pad_token=0))
    for n in (1, 2, 5, 16, 33, 64):
        want = kdtree.build_trees_from_logits(logits, n, n, root_tokens=[1, 2, 3, 4, 5],
                                              root_positions=[0, 3, 9, 1, 2], pad_token=0)
        got = truncate_trees(big, n)
        for name in ("num_nodes", "tokens", "depths", "parents", "logw", "positions", "visibility",
                     "visibility_bits", "first_child", "next_sibling"):
            assert np.array_equal(getattr(got, name).numpy(), np.asarray(getattr(want, name))), (n, name)


def _depth_limited_reference(logits, root, position, cap, budget):
    """The tree of ``budget`` nodes a request that may commit ``cap`` more tokens gets,
    computed another way: a build without the limit at a budget large enough to hold it,
    keeping the nodes of depth <= cap - 1 in pop order (a node's ancestors are shallower,
    so dropping the deeper ones leaves the others' best-first order as it was)."""
    import numpy as np

    import kdtree

    big = 2048
    t = kdtree.build_trees_from_logits(logits[None], big, big, root_tokens=[root], root_positions=[position],
                                       pad_token=0)
    n = int(t.num_nodes[0])
    keep = [i for i in range(1, n + 1) if t.depths[0, i] <= cap - 1][:budget]
    assert len(keep) == budget or n < big or cap <= 1, "the reference budget is too small"
    index = {0: 0} | {old: new for new, old in enumerate(keep, 1)}
    return (np.array([t.tokens[0, i] for i in keep], np.int64), np.array([t.depths[0, i] for i in keep], np.int64),
            np.array([index[int(t.parents[0, i])] for i in keep], np.int64), np.array([t.logw[0, i] for i in keep]))


def _check_depth_follows_remaining(target, drafter, prompts, expected, **kw):
    import numpy as np

    budget = 16
    eng = Engine(target, drafter, max_batch=4, budget=budget, max_length=512, **kw)
    seen = []
    build = eng._build

    def record(b, n, logits, lengths, roots, buf, *rest):
        trees = build(b, n, logits, lengths, roots, buf, *rest)
        host = {k: getattr(trees, k).cpu().numpy().copy() for k in ("num_nodes", "tokens", "depths", "parents", "logw")}
        seen.append((logits.float().cpu().numpy().copy(), lengths.cpu().numpy().copy(), roots.cpu().numpy().copy(),
                     eng.state.remaining[:b].cpu().numpy().copy(), host))
        return trees

    eng._build = record
    caps = [1, 2, 3, 5, 9, NEW]
    ids = [eng.submit(p, c) for p, c in zip(prompts, caps, strict=False)]
    while eng.busy:
        eng.step()
    assert [eng.output(i).tokens for i in ids] == [want[:c] for want, c in zip(expected, caps, strict=False)]
    limited = 0
    for logits, lengths, roots, remaining, trees in seen:
        for r in range(len(remaining)):
            n = int(trees["num_nodes"][r])
            if remaining[r] <= 0:
                assert n == 0
                continue
            want = _depth_limited_reference(logits[r], int(roots[r]), int(lengths[r]), int(remaining[r]), budget)
            for name, w in zip(("tokens", "depths", "parents", "logw"), want, strict=True):
                g = trees[name][r, 1:n + 1].astype(w.dtype)
                # the GPU's top-k log-probs are float32 sums: equal to the CPU's to rounding
                same = np.allclose(g, w, rtol=0, atol=1e-5) if name == "logw" else np.array_equal(g, w)
                assert same, (name, int(remaining[r]), g, w)
            limited += int(remaining[r]) - 1 < eng.depth
    assert limited >= len(caps)


def test_tree_depth_follows_remaining_tokens(pair, prompts, expected):
    """A request that may commit r more tokens accepts at most r - 1 draft tokens: its tree
    spends the budget on depths 1 .. r - 1 only (checked for every request of every round
    against an unlimited build filtered by depth), and the output is still AR's."""
    _check_depth_follows_remaining(*pair, prompts, expected)


@gpu
@pytest.mark.gpu
def test_gpu_tree_depth_follows_remaining_tokens(gpu_pair, prompts, expected):
    """The same on the GPU (eager rounds, so that each round's trees can be read)."""
    _check_depth_follows_remaining(*gpu_pair, prompts, expected, use_graphs=False)


def test_budget_auto(pair, prompts, expected):
    target, drafter = pair
    eng = Engine(target, drafter, max_batch=4, budget="auto", auto_budgets=(4, 16, 64), max_length=512)
    outs = eng.generate(prompts, NEW)
    assert [o.tokens for o in outs] == expected
    assert sum(eng.budget_counts.values()) == eng.stats.rounds
    assert set(eng.budget_counts) <= {4, 16, 64}
    # the expected-token curve, averaged over the probe rounds: non-decreasing in the budget,
    # below the deepest path a request can accept
    curve = eng._curve
    assert curve is not None and (curve[1:] >= curve[:-1] - 1e-12).all() and 0 < curve[-1] <= eng.depth
    with pytest.raises(ValueError, match="mode 'chain'"):
        Engine(target, drafter, budget="auto", mode="chain")


def test_model_usable_after_the_engine(pair, prompts):
    """The engine switches the model to the kdtree attention only inside its forwards: the
    same model object still gives its own logits afterwards."""
    target, drafter = pair
    Engine(target, drafter, max_batch=2, budget=8, max_length=256).generate(prompts[:2], 4)
    fresh = load_causal_lm(PAIR / "target", dtype="float32")
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        assert torch.equal(target(ids).logits, fresh(ids).logits)


@gpu
@pytest.mark.gpu
def test_gpu_mask_without_columns_inside_capture_is_a_kdtree_error():
    """Inside CUDA graph capture, tree_attention_mask without columns= would read the prefix
    lengths to the host: a KdtreeError that says to pass columns, not torch's raw message."""
    import kdtree

    logits = torch.randn(2, 3, 50, device="cuda")
    trees = kdtree.build_trees_from_logits(logits, 4, 4)
    prefix = torch.tensor([3, 5], device="cuda")
    kdtree.tree_attention_mask(trees, prefix, columns=16, errors="status")  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with pytest.raises(kdtree.KdtreeError, match="pass columns="):
        with torch.cuda.graph(g):
            kdtree.tree_attention_mask(trees, prefix, errors="status")


def test_drafter_context_cache_equals_the_module():
    """BlockDrafterKV (context keys/values cached per slot, appended in pieces and into
    any slots) gives the logits BlockDrafterModule.forward computes from all the features."""
    from kdtree.engine.drafter import BlockDrafterKV

    cfg = BlockDrafterConfig(vocab_size=300, feature_size=96, target_layers=(1, 2, 3), hidden_size=64, num_layers=2,
                             num_heads=2, head_dim=32, intermediate_size=128, block_size=8)
    torch.manual_seed(5)
    drafter = BlockDrafter(cfg).eval()
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(3, 20, cfg.feature_size, generator=g)
    lengths = torch.tensor([20, 7, 13])
    roots = torch.tensor([5, 9, 100])
    with torch.no_grad():
        want = drafter(feats, torch.arange(20)[None] < lengths[:, None], roots, lengths, cfg.max_depth)
    kv = BlockDrafterKV(drafter, 4, 40)
    rows = torch.arange(20)[None].expand(3, 20)
    kv.append(feats[:, :12], rows[:, :12].contiguous())  # slots 0 .. 2, first 12 positions
    kv.append(feats[:, 12:], rows[:, 12:].contiguous(), slot=torch.tensor([0, 1, 2]))
    got = kv.forward(roots, lengths, cfg.max_depth)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


@gpu
@pytest.mark.gpu
def test_gpu_stop_sequences_in_the_graph(gpu_pair, prompts, expected):
    """The prepared stop sequences and each slot's history inside the captured round: the
    same outputs as autoregressive decoding, also across round boundaries (the device ends
    a request one round before the host reads it)."""
    target, drafter = gpu_pair
    kw = dict(max_batch=4, budget=32, max_length=512)
    plain = Engine(target, drafter, **kw).generate(prompts[:4], NEW)
    assert [o.tokens for o in plain] == expected[:4]
    cases = _stop_sequence_cases(prompts, expected, [o.committed for o in plain])
    eng = Engine(target, drafter, stop_sequences=[q for _, q, _ in cases], **kw)
    assert eng.use_graphs
    outs = eng.generate([prompts[i] for i, _, _ in cases], NEW)
    ref = load_causal_lm(PAIR / "target", dtype="float32")
    seqs = [q for _, q, _ in cases]
    for (i, q, _), out in zip(cases, outs, strict=True):
        ar = autoregressive_generate(HFTarget(ref), prompts[i], NEW, stop_sequences=seqs)
        assert out.tokens == ar.tokens, (i, q)
        assert out.finish_reason == ar.stop_reason == "stop_sequence"


@gpu
@pytest.mark.gpu
def test_gpu_per_request_stops_with_graphs(gpu_pair, prompts, expected):
    """Per-request stops applied when the host reads a round one step behind the device: the
    outputs of autoregressive decoding with each request's stops; a slot whose request
    ended mid-round is refilled only after the round in flight is read."""
    target, drafter = gpu_pair
    kw = dict(max_batch=2, budget=32, max_length=512)
    token_cases = [(i, want[k]) for i, want in enumerate(expected[:8]) for k in range(3, NEW)
                   if want[k] not in want[:k]][:4]
    eng = Engine(target, drafter, **kw)
    assert eng.use_graphs
    prompts_in = [prompts[i] for i, _ in token_cases] + [prompts[9]]
    params = [SamplingParams(stop_token_ids=[stop]) for _, stop in token_cases] + [SamplingParams()]
    outs = eng.generate(prompts_in, NEW, sampling=params)
    ref = load_causal_lm(PAIR / "target", dtype="float32")
    for (i, stop), out in zip(token_cases, outs, strict=False):
        ar = autoregressive_generate(HFTarget(ref), prompts[i], NEW, stop_tokens=[stop])
        assert out.tokens == ar.tokens and out.finish_reason == ar.stop_reason == "stop_token", (i, stop)
    assert outs[-1].tokens == expected[9]


@gpu
@pytest.mark.gpu
def test_gpu_abort_with_a_round_in_flight(gpu_pair, prompts, expected):
    """abort() between steps while the host reads rounds one step behind the device: the
    aborted slot's in-flight round is read and dropped, and the slot is refilled after."""
    _abort_and_release(*gpu_pair, prompts, expected)


def test_generate_queues_nothing_when_a_request_is_refused(pair, prompts, expected):
    target, drafter = pair
    eng = Engine(target, drafter, max_batch=2, budget=8, max_length=512)
    with pytest.raises(ValueError, match="prompt 1: this engine verifies greedily"):
        eng.generate(prompts[:2], 4, [SamplingParams(), SamplingParams(temperature=0.5)])
    with pytest.raises(ValueError, match="prompt 0: the prompt must hold at least one token"):
        eng.generate([[], prompts[1]], 4)
    assert not eng.busy  # nothing of the refused calls was queued
    outs = eng.generate(prompts[:2], 4)
    assert [o.tokens for o in outs] == [e[:4] for e in expected[:2]] and eng._next_id == 2


@gpu
@pytest.mark.gpu
def test_gpu_a_request_with_nan_activations_fails_alone(prompts, expected):
    _nan_request(prompts, expected, "ddtree", "cuda")
