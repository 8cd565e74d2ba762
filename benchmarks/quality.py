"""Quality report of the trained default model (`small`): what each approximation costs.

1. Validation loss (nats/token, bits/byte) on the held-out split the model was trained with (the
   last 2 % of each corpus file, cut at a line start, dsv41/training/data.py): fp32 masters vs the
   exported FP8/MXFP4 checkpoint; Shakespeare and Python separately and together; anchors from
   nanoGPT's character-level Shakespeare converted to bits/byte (ASCII text: chars = bytes).
2. CED + bounded replay vs the `exact` prefill at several prompt lengths: perplexity of the next
   64 held-out tokens (teacher forced through decode steps after the prefill) and greedy
   agreement over 64 free-running tokens from each prefill.
3. A multi-turn session (the prompt grows by a "tool result" each turn, each turn hits the
   previous turn's stored blocks): the continuation after a prefix hit with encoder replay vs
   the same prompt prefilled `exact`, on the same packed cache format.
4. FP4 main KV + MXFP4 index keys vs the same entries kept in bf16 (`bf16_global_kv`: the FP4
   rounding of compressed entries, index keys and the index queries that score them replaced by
   bf16 rounding, in prefill and decode alike; the FP8 SWA rings and the weights are unchanged).

Writes benchmarks/results/quality.json; `--sections` reruns some parts and keeps the others'
results from the file (each part records when it ran). Runs on `--threads` torch threads (default 2).
Usage: python benchmarks/quality.py [--quick] [--sections validation,replay,session,cache]
       [--checkpoint runs/small/ckpt-000450.pt]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.ced_error import agreement  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CORPUS = ROOT.parent / "shared" / "data" / "corpus"
FILES = {"shakespeare": "tinyshakespeare_input.txt", "python": "cpython_3.11.7_lib.txt"}
VAL_FRACTION = 0.02
# nanoGPT, shakespeare_char: best validation loss in nats/char (README)
ANCHORS = {"nanoGPT 10.7M GPU (shakespeare_char)": 1.47, "nanoGPT small CPU (shakespeare_char)": 1.88}
GOALS = {"weights_loss_increase": 0.02, "replay_ppl_increase": 0.01, "replay_agreement": 0.90,
         "fp4_cache_ppl_increase": 0.01}


# ---- metric functions (tested in tests/test_quality_bench.py) ----

def perplexity(nll_sum: float, count: int) -> float:
    """exp of the mean negative log-likelihood (nats) over `count` tokens."""
    return math.exp(nll_sum / count)


def bits_per_byte(nll_sum: float, n_bytes: int) -> float:
    """Total loss in nats over a text, as bits per UTF-8 byte of that text."""
    return nll_sum / math.log(2) / n_bytes


def nats_per_char_to_bits_per_byte(nats: float) -> float:
    """A per-character loss on ASCII text (one byte a character) in bits/byte."""
    return nats / math.log(2)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed cross entropy (nats) of logits [n, vocab] against targets [n]."""
    return F.cross_entropy(logits.float(), targets, reduction="sum").item()


# ---- the bf16 baseline of the FP4 cache formats ----

def _bf16(x: torch.Tensor, *_args) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


@contextlib.contextmanager
def bf16_global_kv() -> Iterator[None]:
    """Within the block, FP4 entry formats (main KV, index keys) and the MXFP4 index queries round
    to bf16 instead; FP8 formats (SWA rings) keep their rounding. Restores the formats on exit."""
    from dsv41.kernels import layouts
    from dsv41.model import attention, pages

    # the rings and the page stores both quantize through pages.to_stored
    originals = [(attention, "main_kv_qdq"), (attention, "mxfp4_qdq"), (pages, "quantize_dequantize")]
    saved = [getattr(module, name) for module, name in originals]

    def entry_values(x: torch.Tensor, fmt) -> torch.Tensor:
        return _bf16(x) if fmt.fp4 else layouts.quantize_dequantize(x, fmt)

    replacements = [_bf16, _bf16, entry_values]
    try:
        for (module, name), new in zip(originals, replacements, strict=True):
            setattr(module, name, new)
        yield
    finally:
        for (module, name), old in zip(originals, saved, strict=True):
            setattr(module, name, old)


# ---- data ----

def held_out(tokenizer) -> dict[str, dict]:
    """Per corpus file: its held-out text, UTF-8 byte count and token stream (BOS text EOS)."""
    from dsv41.training.data import _tokens, split_text

    out = {}
    for name, file in FILES.items():
        text = split_text((CORPUS / file).read_text(encoding="utf-8"), VAL_FRACTION)[1]
        out[name] = {"text": text, "bytes": len(text.encode("utf-8")), "ids": _tokens(tokenizer, [text])}
    return out


def windows(stream: torch.Tensor, length: int, count: int) -> list[torch.Tensor]:
    """`count` windows of `length` tokens at evenly spaced starts of the stream."""
    last = stream.numel() - length
    if last < 0:
        return []
    starts = [round(i * last / max(count - 1, 1)) for i in range(count)] if count > 1 else [0]
    return [stream[s : s + length] for s in starts]


# ---- 1. validation loss ----

@torch.inference_mode()
def stream_loss(model, ids: torch.Tensor, seq_len: int, max_windows: int | None, **kw) -> tuple[float, int, int]:
    """(summed nats, predicted tokens, windows) over consecutive windows of seq_len + 1 tokens."""
    total, count, n = 0.0, 0, 0
    for start in range(0, ids.numel() - 1, seq_len):
        if max_windows is not None and n >= max_windows:
            break
        chunk = ids[start : start + seq_len + 1]
        if chunk.numel() < 2:
            break
        logits = model(chunk[None, :-1], **kw).logits[0]
        total, count, n = total + nll(logits, chunk[1:]), count + chunk.numel() - 1, n + 1
    return total, count, n


def validation(models: dict, data: dict, seq_len: int, max_windows: int | None) -> dict:
    out = {}
    for label, (model, kw) in models.items():
        per, tot_nll, tot_tok, tot_bytes = {}, 0.0, 0, 0
        for name, d in data.items():
            t0 = time.perf_counter()
            s, c, n = stream_loss(model, d["ids"], seq_len, max_windows, **kw)
            # bytes of the evaluated part: the whole text when every window ran, else pro rata by tokens
            covered = d["bytes"] if c >= d["ids"].numel() - 1 else round(d["bytes"] * c / (d["ids"].numel() - 1))
            per[name] = {"nats_per_token": s / c, "bits_per_byte": bits_per_byte(s, covered), "tokens": c,
                         "bytes": covered, "windows": n, "seconds": round(time.perf_counter() - t0, 1)}
            tot_nll, tot_tok, tot_bytes = tot_nll + s, tot_tok + c, tot_bytes + covered
            print(f"  {label:<10} {name:<12} {s / c:6.3f} nats/token {per[name]['bits_per_byte']:6.3f} bits/byte "
                  f"({c} tokens)", flush=True)
        per["all"] = {"nats_per_token": tot_nll / tot_tok, "bits_per_byte": bits_per_byte(tot_nll, tot_bytes),
                      "tokens": tot_tok, "bytes": tot_bytes}
        out[label] = per
    return out


# ---- 2-4. engine continuations ----

@torch.inference_mode()
def continuation(core, seq, first_logits: torch.Tensor, target: list[int]) -> tuple[float, list[int], list[int]]:
    """Teacher-forced nats of `target` after a prefill and the argmax at each of those positions,
    then (after rolling back) the free-running greedy tokens of the same length from the same state."""
    saved = core.checkpoint(seq)
    logits, total, forced = first_logits, 0.0, []
    for tok in target:
        total += nll(logits[None], torch.tensor([tok]))
        forced.append(int(logits.argmax()))
        logits = core.step(seq, [tok])[0]
    core.rollback(seq, saved)
    logits, greedy = first_logits, []
    for _ in target:
        greedy.append(int(logits.argmax()))
        logits = core.step(seq, [greedy[-1]])[0]
    return total, greedy, forced


def compare(ref: tuple, test: tuple, n: int) -> dict:
    """Perplexities and their ratio; free-running greedy agreement and common prefix; and the
    teacher-forced top-1 agreement (same prefix at every position, so one flip does not carry on)."""
    share, prefix = agreement(test[1], ref[1])
    forced = sum(a == b for a, b in zip(test[2], ref[2], strict=True)) / len(ref[2])
    return {"ppl_ref": perplexity(ref[0], n), "ppl": perplexity(test[0], n),
            "ppl_ratio": perplexity(test[0], n) / perplexity(ref[0], n), "greedy_agreement": share,
            "common_prefix": prefix, "forced_agreement": forced}


def run_prefill(core, ids: list[int], mode: str, target: list[int], packed: bool = False):
    seq, logits = core.prefill(ids, mode, capacity=len(ids) + len(target) + 1, packed=packed)
    try:
        return continuation(core, seq, logits, target)
    finally:
        core.release(seq)


def summarise(rows: list[dict], key: str) -> list[dict]:
    """Pooled per `key`: perplexity ratio of the summed losses, mean agreement."""
    out = []
    for value in dict.fromkeys(r[key] for r in rows):
        group = [r for r in rows if r[key] == value]
        n = sum(r["tokens"] for r in group)
        ref, test = sum(r["nll_ref"] for r in group), sum(r["nll"] for r in group)
        out.append({key: value, "windows": len(group), "ppl_ref": perplexity(ref, n), "ppl": perplexity(test, n),
                    "ppl_ratio": perplexity(test, n) / perplexity(ref, n),
                    "greedy_agreement": sum(r["greedy_agreement"] for r in group) / len(group),
                    "min_agreement": min(r["greedy_agreement"] for r in group),
                    "forced_agreement": sum(r["forced_agreement"] for r in group) / len(group)})
    return out


def replay_vs_exact(core, stream: torch.Tensor, lengths: list[int], per_length: int, steps: int) -> dict:
    rows = []
    for n in lengths:
        for w in windows(stream, n + steps, per_length):
            ids, target = w[:n].tolist(), w[n:].tolist()
            ref, test = run_prefill(core, ids, "exact", target), run_prefill(core, ids, "ced", target)
            row = {"length": n, **compare(ref, test, steps), "nll_ref": ref[0], "nll": test[0], "tokens": steps}
            rows.append(row)
            print(f"  {n:>5} ppl exact {row['ppl_ref']:7.3f} ced {row['ppl']:7.3f} ratio {row['ppl_ratio']:.4f} "
                  f"agree {row['greedy_agreement']:.2f} forced {row['forced_agreement']:.2f}", flush=True)
    return {"rows": rows, "summary": summarise(rows, "length")}


def multi_turn(core, data: dict, turns: int, first: int, growth: int, steps: int, block: int) -> dict:
    """Turn t's prompt = turn t-1's prompt + a tool result of `growth` held-out Python tokens; the
    stored blocks of turn t-1's prompt are the prefix hit of turn t (encoder replay, no snapshot)."""
    from dsv41.model.cache import export_blocks
    from dsv41.storage.blockfmt import BlockLayout

    layout = BlockLayout.of(core.model.config, block)
    conv = data["shakespeare"]["ids"]
    tool = data["python"]["ids"]
    prompt = conv[:first].tolist()
    rows, blocks, offset = [], [], 0
    for turn in range(turns):
        source = (tool, offset + growth) if turn else (conv, first)
        target = source[0][source[1] : source[1] + steps].tolist()
        cap = len(prompt) + steps + 1
        if blocks:
            with torch.inference_mode():
                seq, logits = core.prefill_from_prefix(prompt, blocks, layout, capacity=cap)
            try:
                test = continuation(core, seq, logits, target)
            finally:
                core.release(seq)
            ref = run_prefill(core, prompt, "exact", target, packed=True)
            row = {"turn": turn, "prompt": len(prompt), "cached_tokens": len(blocks) * block,
                   **compare(ref, test, steps), "nll_ref": ref[0], "nll": test[0], "tokens": steps}
            rows.append(row)
            print(f"  turn {turn} prompt {len(prompt):>5} hit {row['cached_tokens']:>5} ppl exact "
                  f"{row['ppl_ref']:7.3f} hit {row['ppl']:7.3f} ratio {row['ppl_ratio']:.4f} "
                  f"agree {row['greedy_agreement']:.2f} forced {row['forced_agreement']:.2f}", flush=True)
        # this turn's stored blocks (a packed prefill of the whole prompt, as a served turn would store)
        with torch.inference_mode():
            seq, _ = core.prefill(prompt, "ced", packed=True)
            blocks = export_blocks(seq.cache, layout, 0, len(prompt) // block)
            core.release(seq)
        prompt = prompt + tool[offset : offset + growth].tolist()
        offset += growth + steps
    n = sum(r["tokens"] for r in rows)
    pooled = {"ppl_ratio": perplexity(sum(r["nll"] for r in rows), n) / perplexity(sum(r["nll_ref"] for r in rows), n),
              "greedy_agreement": sum(r["greedy_agreement"] for r in rows) / len(rows),
              "forced_agreement": sum(r["forced_agreement"] for r in rows) / len(rows)}
    return {"block_tokens": block, "growth": growth, "rows": rows, "summary": pooled}


def fp4_vs_bf16(core, stream: torch.Tensor, lengths: list[int], per_length: int, steps: int) -> dict:
    """The served format (packed FP4 caches) against the same run with bf16 global-KV entries."""
    rows = []
    for n in lengths:
        for w in windows(stream, n + steps, per_length):
            ids, target = w[:n].tolist(), w[n:].tolist()
            with bf16_global_kv():
                ref = run_prefill(core, ids, "exact", target, packed=False)
            test = run_prefill(core, ids, "exact", target, packed=True)
            row = {"length": n, **compare(ref, test, steps), "nll_ref": ref[0], "nll": test[0], "tokens": steps}
            rows.append(row)
            print(f"  {n:>5} ppl bf16 {row['ppl_ref']:7.3f} packed {row['ppl']:7.3f} ratio {row['ppl_ratio']:.4f} "
                  f"agree {row['greedy_agreement']:.2f} forced {row['forced_agreement']:.2f}", flush=True)
    return {"rows": rows, "summary": summarise(rows, "length")}


SECTIONS = ("validation", "replay", "session", "cache")


def goals(result: dict) -> dict:
    """Each goal of the report, its measured value and whether it is met (from the results present)."""
    checks = {}
    val = result.get("validation", {})
    if "fp32" in val and "exported" in val:
        inc = val["exported"]["all"]["nats_per_token"] / val["fp32"]["all"]["nats_per_token"] - 1
        checks["weights_loss_increase"] = {"value": inc, "goal": f"<= {GOALS['weights_loss_increase']:.0%}",
                                           "met": inc <= GOALS["weights_loss_increase"]}
    if "replay_vs_exact" in result:
        summary = result["replay_vs_exact"]["summary"]
        worst_ppl = max(r["ppl_ratio"] for r in summary) - 1
        worst_agree = min(r["greedy_agreement"] for r in summary)
        checks["replay_ppl_increase"] = {"value": worst_ppl, "goal": "<= 1% (worst length)",
                                         "met": worst_ppl <= GOALS["replay_ppl_increase"]}
        checks["replay_agreement"] = {"value": worst_agree, "goal": ">= 90% (worst length)",
                                      "met": worst_agree >= GOALS["replay_agreement"]}
    if "multi_turn" in result:
        s = result["multi_turn"]["summary"]
        checks["session_replay_ppl_increase"] = {"value": s["ppl_ratio"] - 1, "goal": "<= 1%",
                                                 "met": s["ppl_ratio"] - 1 <= GOALS["replay_ppl_increase"]}
        checks["session_replay_agreement"] = {"value": s["greedy_agreement"], "goal": ">= 90%",
                                              "met": s["greedy_agreement"] >= GOALS["replay_agreement"]}
    if "fp4_vs_bf16_cache" in result:
        worst = max(r["ppl_ratio"] for r in result["fp4_vs_bf16_cache"]["summary"]) - 1
        checks["fp4_cache_ppl_increase"] = {"value": worst, "goal": "<= 1% (worst length)",
                                            "met": worst <= GOALS["fp4_cache_ppl_increase"]}
    return checks


def print_report(result: dict) -> None:
    print("\nvalidation loss        nats/token  bits/byte")
    for label, per in result.get("validation", {}).items():
        for name in ("shakespeare", "python", "all"):
            print(f"  {label:<9} {name:<12} {per[name]['nats_per_token']:8.3f} {per[name]['bits_per_byte']:9.3f}")
    for k, v in result["anchors"].items():
        print(f"  anchor {k}: {v['nats_per_char']} nats/char = {v['bits_per_byte']:.3f} bits/byte")
    if "replay_vs_exact" in result:
        print("\nlength  ppl exact  ppl ced  ratio  greedy agreement  forced top-1 agreement")
        for r in result["replay_vs_exact"]["summary"]:
            print(f"{r['length']:>6} {r['ppl_ref']:10.3f} {r['ppl']:8.3f} {r['ppl_ratio']:6.4f} "
                  f"{r['greedy_agreement']:17.2f} {r['forced_agreement']:23.2f}")
    print("\ngoal                          value    met")
    for k, c in result["goals"].items():
        print(f"  {k:<28} {c['value']:8.4f} {'yes' if c['met'] else 'NO'} ({c['goal']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "runs" / "small" / "ckpt-000450.pt"),
                        help="the fp32 training checkpoint of the model (validation compares it when present)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--quick", action="store_true", help="fewer windows (a few minutes)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated parts to run, of {', '.join(SECTIONS)}; the others are kept from "
                             "the results file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    torch.set_num_threads(args.threads)
    from dsv41.checkpoint import load_model
    from dsv41.engine.core import InferenceCore
    from dsv41.model.tokenizer import load_tokenizer
    from dsv41.training.export import load_trained

    path = RESULTS / "quality.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    ran = result.setdefault("ran", {})
    quant, _ = load_model(args.model)
    quant.eval()
    tokenizer = load_tokenizer(args.model, quant.config.text_config.vocab_size)
    data = held_out(tokenizer)
    limit = quant.config.text_config.max_position_embeddings
    q, per_length = args.quick, 1 if args.quick else 3
    core = InferenceCore(quant, chunk_size=512)
    both = torch.cat([data["python"]["ids"], data["shakespeare"]["ids"]])
    setup = {"model": args.model, "quick": q, "threads": args.threads, "steps": args.steps}

    for section in sections:
        t0 = time.perf_counter()
        if section == "validation":
            models = {"exported": (quant, {})}
            if Path(args.checkpoint).is_file():
                masters, *_ = load_trained(args.checkpoint)
                masters.train()  # the training forward (fp32 weights, straight-through cache rounding), as validated
                models = {"fp32": (masters, {}), **models}
            val_windows = 2 if q else 12
            print(f"validation loss (512-token windows, up to {val_windows} per file)")
            result["validation"] = validation(models, data, 512, val_windows)
            setup["checkpoint"] = args.checkpoint if "fp32" in models else None
        elif section == "replay":
            print("ced + bounded replay vs exact prefill")
            result["replay_vs_exact"] = replay_vs_exact(core, both, [256, 512, 1024, 2048, limit - args.steps],
                                                        per_length, args.steps)
        elif section == "session":
            print("multi-turn session: prefix hit + replay vs exact")
            result["multi_turn"] = multi_turn(core, data, 3 if q else 5, 200, 300, args.steps, 64)
        else:
            print("FP4 main KV + MXFP4 index keys vs bf16 entries (exact prefill)")
            lengths = [1024, 2048] if q else [512, 1024, 2048, limit - args.steps]
            result["fp4_vs_bf16_cache"] = fp4_vs_bf16(core, both, lengths, per_length, args.steps)
        ran[section] = {**setup, "seconds": round(time.perf_counter() - t0),
                        "date": time.strftime("%Y-%m-%d %H:%M:%S")}

    result["anchors"] = {k: {"nats_per_char": v, "bits_per_byte": nats_per_char_to_bits_per_byte(v)}
                         for k, v in ANCHORS.items()}
    result["goals"] = goals(result)
    print_report(result)
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
