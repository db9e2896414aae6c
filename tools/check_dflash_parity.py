#!/usr/bin/env python3
"""kdtree's DFlash drafter against the published module, on random-weight checkpoints.

The published module is read from a local copy of its source (it is not part of kdtree):
the DDTree release's ``model/`` folder (``git clone https://github.com/liranringel/ddtree``),
given as ``--published DIR``. For each block size and ``target_layer_ids`` below, a random
Qwen3 target and a random DFlash drafter are made, the drafter is saved in the published
format with :func:`kdtree.engine.dflash.save_dflash`, loaded both ways (kdtree's
:func:`~kdtree.engine.dflash.load_dflash` and the published class's ``from_pretrained``),
and the draft logits of both are compared in float32 over a context of target features:
kdtree's module, kdtree's cached decoder (:class:`~kdtree.engine.dflash.DFlashKV`) and the
published module with its cache used the way its ``spec_generate`` uses it (two rounds).

    python tools/check_dflash_parity.py --published /path/to/ddtree/model

Prints the max |difference| of each case; exit 1 if any exceeds --tol (default 1e-4).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))


def load_published(folder: Path):
    """The published ``DFlashDraftModel`` class, imported from ``folder`` (its ``utils``
    imports ``datasets`` for benchmarks only: a stand-in module is given when absent)."""
    if importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.load_dataset = stub.Features = stub.Sequence = stub.Value = None
        sys.modules["datasets"] = stub
    pkg = types.ModuleType("published_dflash")
    pkg.__path__ = [str(folder)]
    sys.modules["published_dflash"] = pkg
    for name in ("utils", "dflash"):
        spec = importlib.util.spec_from_file_location(f"published_dflash.{name}", folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"published_dflash.{name}"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["published_dflash.dflash"].DFlashDraftModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--published", type=Path, required=True, help="the DDTree release's model/ folder")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    import torch
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    from kdtree.engine.dflash import DFlashDrafter, DFlashKV, dflash_config, load_dflash, save_dflash

    Published = load_published(args.published)
    torch.manual_seed(0)
    tcfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                       tie_word_embeddings=False)
    target = Qwen3ForCausalLM(tcfg).float().eval()
    with torch.no_grad():  # logits of a trained model's scale (tens), not random init's (~1)
        target.get_output_embeddings().weight.mul_(30.0)
    worst = 0.0
    for block, ids, layers in ((8, [1, 3, 5], 2), (16, [0, 6], 1), (16, None, 3), (8, [2], 1)):
        d = {k: v for k, v in tcfg.to_dict().items() if k not in ("architectures", "layer_types")}
        d.update(num_hidden_layers=layers, block_size=block, num_target_layers=tcfg.num_hidden_layers,
                 dflash_config={"mask_token_id": 7} | ({"target_layer_ids": ids} if ids else {}))
        cfg = dflash_config(d)
        model = DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        with tempfile.TemporaryDirectory() as tmp:
            save_dflash(model, tmp)
            ours = load_dflash(tmp, target, dtype="float32")
            theirs = Published.from_pretrained(tmp, torch_dtype=torch.float32).eval()
        ids_used = list(cfg.dflash_config["target_layer_ids"])
        t, s = 37, block
        tokens = torch.randint(0, tcfg.vocab_size, (1, t + 1))
        with torch.no_grad():
            hs = target(tokens[:, :t], output_hidden_states=True).hidden_states
            feats = torch.cat([hs[i + 1] for i in ids_used], dim=-1)
            root = tokens[:, t]
            a = ours(feats, torch.ones((1, t), dtype=torch.bool), root, torch.tensor([t]))
            kv = DFlashKV(ours, 1, 64)
            kv.append(feats, torch.arange(t)[None])
            b = kv.forward(root, torch.tensor([t]))
            # the published module, as spec_generate calls it: a fresh cache, the context's
            # features, the block of [root, mask...] embedded by the target, positions 0 .. t+s-1
            block_ids = torch.full((1, s), cfg.dflash_config["mask_token_id"])
            block_ids[:, 0] = root
            cache = DynamicCache()
            h = theirs(target_hidden=feats, noise_embedding=target.get_input_embeddings()(block_ids),
                       position_ids=torch.arange(t + s)[None], past_key_values=cache, use_cache=True,
                       is_causal=False)
            c = target.get_output_embeddings()(h[:, -s + 1:, :])
            # a second round after 3 accepted tokens: the published cache cropped to t, the new
            # features appended; kdtree's cache appended at rows t .. t+3
            # (spec_generate's crop(start); transformers 5 crops by a negative count)
            cache.crop(t - cache.get_seq_length())
            more = torch.randint(0, tcfg.vocab_size, (1, 4))
            seq = torch.cat([tokens[:, :t], more], 1)
            hs2 = target(seq, output_hidden_states=True).hidden_states
            f2 = torch.cat([hs2[i + 1] for i in ids_used], dim=-1)
            root2 = seq[:, -1]
            new = f2[:, t:t + 3]
            block_ids[:, 0] = root2
            h2 = theirs(target_hidden=new, noise_embedding=target.get_input_embeddings()(block_ids),
                        position_ids=torch.arange(t, t + 3 + s)[None], past_key_values=cache, use_cache=True,
                        is_causal=False)
            c2 = target.get_output_embeddings()(h2[:, -s + 1:, :])
            kv.append(new, torch.arange(t, t + 3)[None])
            b2 = kv.forward(root2, torch.tensor([t + 3]))
            a2 = ours(f2[:, :t + 3], torch.ones((1, t + 3), dtype=torch.bool), root2, torch.tensor([t + 3]))
        diffs = [float((x - c).abs().max()) for x in (a, b)] + [float((x - c2).abs().max()) for x in (a2, b2)]
        worst = max(worst, *diffs)
        print(f"block_size {block:2}, target_layer_ids {ids_used}, {layers} layer(s): max |logit diff| "
              f"module {diffs[0]:.2e}, cached {diffs[1]:.2e}; after a round: module {diffs[2]:.2e}, "
              f"cached {diffs[3]:.2e} (logits' scale {float(c.abs().max()):.1f})")
    print(f"worst {worst:.2e} (tolerance {args.tol:g})")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
