"""Hard cases for the batched engine (kdtree.engine.batched) and ``kdtree generate
--batch-size/--prompts-file``: greedy output equal to the target's own autoregressive
decoding also when two engines share one model, and a clear error naming what is wrong for
every bad input (never a traceback, a silent coercion or a wrong answer).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (nox -s test installs it)")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (nox -s test installs it)")

from kdtree.engine.batched import Engine  # noqa: E402
from kdtree.engine.drafter import BlockDrafter, BlockDrafterConfig  # noqa: E402
from test_engine_batched import reference  # noqa: E402
from test_generate_cli import MODELS, run_cli  # noqa: E402


def varied(seed: int = 0):
    """A float64 tiny Qwen3 whose greedy continuations vary (no repeated-token fixed point),
    so that two different prompts have different continuations."""
    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model


def drafter():
    cfg = BlockDrafterConfig(vocab_size=97, feature_size=64, target_layers=(1, 2), hidden_size=32, num_layers=1,
                             num_heads=2, head_dim=16, intermediate_size=64, block_size=5)
    torch.manual_seed(2)
    return BlockDrafter(cfg).to(torch.float64).eval()


# ---- the engine ------------------------------------------------------------------------------


def test_two_engines_on_one_target_keep_their_own_caches():
    """Two engines on one target (an AR baseline beside a DDTree engine, as the CLI and the
    benchmark build them) each decode correctly: greedy output equals the target's
    autoregressive decoding."""
    model, ref, d = varied(), varied(), drafter()
    want = reference(ref, [[5], [60]], 12)
    assert want[0] != want[1]
    first = Engine(model, d, max_batch=1, budget=8, max_length=64)
    second = Engine(model, d, max_batch=1, budget=8, max_length=64)
    assert second.generate([[60]], 12)[0].tokens == want[1]
    try:
        got = first.generate([[5]], 12)[0].tokens
    except (ValueError, RuntimeError) as exc:  # a clear refusal is acceptable
        assert "engine" in str(exc).lower() and "expanded size" not in str(exc), exc
        return
    assert got == want[0], f"first engine returned {got}, expected {want[0]} (the other engine's continuation is {want[1]})"


def test_stop_tokens_are_validated():
    """Promise: every bad input gets a clear error naming what is wrong."""
    model, d = varied(), drafter()
    for bad in ([3.7], [1000], [-1]):
        with pytest.raises(ValueError, match="stop"):
            Engine(model, d, max_batch=1, budget=4, max_length=64, stop_tokens=bad)


def test_budget_beyond_kdtree_limit_is_a_clear_error():
    """Promise: bad sizes raise ValueError (Engine's docstring), never an over-allocation."""
    model, d = varied(), drafter()
    with pytest.raises(ValueError, match="budget"):
        Engine(model, d, max_batch=1, budget=2**40, max_length=64)


def test_submit_rejects_a_sampling_that_is_not_sampling_params():
    """Promise: a clear error naming the bad argument."""
    eng = Engine(varied(), drafter(), max_batch=1, budget=4, max_length=64)
    with pytest.raises((TypeError, ValueError), match="sampling"):
        eng.submit([1, 2], 4, sampling="greedy")


# ---- the prompts file and the CLI -----------------------------------------------------------


def test_prompts_file_escaped_backslash_before_n(tmp_path):
    """Promise (apps/batched.py docstring): plain lines decode ``\\n`` and ``\\\\`` escapes."""
    from kdtree.apps.batched import read_prompts

    f = tmp_path / "p.txt"
    f.write_text('print("a\\\\nb")\n')  # the file holds: print("a\\nb")
    assert [e["prompt"] for e in read_prompts(f)] == ['print("a\\nb")']


def batched_cli(tmp_path, lines: str, *extra):
    f = tmp_path / "prompts.txt"
    f.write_text(lines)
    return run_cli(["generate", "--batch-size", "2", "--prompts-file", str(f), "--no-progress", "--budget", "8",
                    "--max-new-tokens", "4", "--models", str(MODELS), *extra], tmp_path)


@pytest.mark.parametrize("value", ['"ten"', "null", "1e400", "-3"])
def test_cli_bad_max_new_tokens_is_a_usage_error(tmp_path, value):
    """Promise: a bad prompts file is a usage error naming the line (exit 2), never a
    traceback."""
    r = batched_cli(tmp_path, f'{{"prompt": "def f(", "max_new_tokens": {value}}}\n'
                              '{"prompt": "import os\\nimport sys", "max_new_tokens": 4}\n')
    assert r.returncode == 2, r.stderr[-800:]
    assert "Traceback" not in r.stderr
    assert "max_new_tokens" in r.stderr


@pytest.mark.parametrize("field,value", [("temperature", "true"), ("temperature", '"0.7"'), ("top_k", "2.5"),
                                         ("max_new_tokens", "2.9")])
def test_cli_wrongly_typed_settings_are_refused(tmp_path, field, value):
    """Promise: JSON with wrong types is refused with a usage error."""
    extra = ', "temperature": 0.5' if field == "top_k" else ""
    r = batched_cli(tmp_path, f'{{"prompt": "def f(", "{field}": {value}{extra}}}\n', "--no-ar")
    assert r.returncode == 2, (r.returncode, r.stdout[-400:])
    assert field in r.stderr


def test_cli_prompt_longer_than_the_target_is_a_usage_error(tmp_path):
    """Promise: a bad prompts file is a usage error, never a traceback."""
    r = batched_cli(tmp_path, "x" * 100_000 + "\n", "--no-ar")
    assert r.returncode == 2, r.stderr[-800:]
    assert "Traceback" not in r.stderr
    assert "prompt 0" in r.stderr or "line 1" in r.stderr


def test_cli_all_requests_with_zero_new_tokens(tmp_path):
    """Promise: no crash on valid input."""
    r = batched_cli(tmp_path, '{"prompt": "def f(", "max_new_tokens": 0}\n')
    assert r.returncode == 0, r.stderr[-800:]
    assert "Traceback" not in r.stderr
