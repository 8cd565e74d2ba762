"""DSpark speculative decoding on the default model, on held-out Shakespeare and Python text.

Prompts are cut from the held-out tail of each corpus file (the validation split of `dsv41 train`,
never trained on). For each prompt:

* plain greedy decoding (one engine step per token) and greedy speculative decoding with fixed
  draft lengths 1..5 (`dsv41.engine.speculative.greedy_speculative`) generate the same number of
  tokens; outputs are compared token for token with plain decoding, and timed. Times are CPU
  seconds of this process on one thread (`time.process_time`): the machine is shared, and wall
  time there measures the other processes. Wall seconds are reported beside them.
* the drafter drafts a full block after every generated position of the plain continuation
  (observe up to p, draft after the token at p): acceptance by draft position (draft i accepted
  given drafts < i were) and the confidence head's calibration (predicted sigmoid against the
  observed acceptance, in 10 bins over positions whose prefix was accepted; a reliability plot).
* the length scheduler (`dsv41.engine.dspark_scheduler.choose_lengths`, mode auto) is driven by a
  verification cost curve measured here (CPU seconds of one engine step of 1..6 tokens at batch 1)
  and by the confidence of each draft above; its tokens/s is modelled from those measured pieces
  (drafter time + verification cost; a rejected draft is cut from the step in place, nothing
  runs twice), not run: the engine's speculative loop here takes a fixed length.

Batch 8 (and `auto` run for real) is measured through the pipeline by
benchmarks/dspark_pipeline.py, where the dspark component verifies a batch in one step.
Prints a table; writes benchmarks/results/dspark.json and a reliability plot
(benchmarks/results/dspark_calibration.png, or .csv without matplotlib).

Usage: python benchmarks/dspark.py [--model small] [--prompts 4] [--prompt-len 64] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from dsv41.checkpoint import load_model, open_model_dir, resolve_model_dir, weight_files
from dsv41.engine.core import InferenceCore
from dsv41.engine.dspark_scheduler import choose_lengths, prefix_survival
from dsv41.engine.speculative import SpecStats, greedy_speculative, plain_greedy
from dsv41.model.dspark import Drafter, has_drafter, load_dspark, new_state
from dsv41.training.data import _tokens, split_text

RESULTS = Path(__file__).parent / "results"
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus"
DOMAINS = {"shakespeare": "tinyshakespeare_input.txt", "python": "cpython_3.11.7_lib.txt"}
GOALS = {"acceptance_length": 3.0, "speedup_batch1": 2.0}


def held_out_prompts(tokenizer: Tokenizer, n: int, length: int, val_fraction: float = 0.02) -> dict[str, list]:
    """n prompts of `length` tokens per domain, evenly spaced over the held-out tail."""
    out = {}
    for domain, name in DOMAINS.items():
        _, held_out = split_text((CORPUS / name).read_text(encoding="utf-8"), val_fraction)
        stream = _tokens(tokenizer, [held_out])
        starts = torch.linspace(0, stream.numel() - length - 1, n).long().tolist()
        out[domain] = [stream[s : s + length].tolist() for s in starts]
    return out


class TimedDrafter:
    """The drafter with the CPU time of its calls counted (the drafter's share of a run)."""

    def __init__(self, drafter: Drafter):
        self.inner, self.block, self.seconds = drafter, drafter.block, 0.0

    def observe(self, state, hidden):
        t0 = time.process_time()
        self.inner.observe(state, hidden)
        self.seconds += time.process_time() - t0

    def draft(self, states, tokens):
        t0 = time.process_time()
        out = self.inner.draft(states, tokens)
        self.seconds += time.process_time() - t0
        return out


def timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    value = fn()
    return value, time.process_time() - c0, time.perf_counter() - w0


@torch.inference_mode()
def prefill_seconds(core: InferenceCore, prompt: list[int]) -> float:
    """CPU seconds of the prompt's prefill (taken out of both runs' times: tokens/s of decoding)."""
    _, cpu, _ = timed(lambda: core.release(core.prefill(prompt, mode="full")[0]))
    return cpu


def decode_runs(core, drafter, prompts, n_new: int) -> dict:
    """Plain and fixed-length speculative runs of every prompt, interleaved so that both see the
    same machine; CPU and wall seconds of decoding (prefill subtracted). Also returns the plain
    continuations."""
    lengths = range(1, drafter.block + 1)
    rows = {"plain": {"cpu": 0.0, "wall": 0.0, "tokens": 0}}
    rows |= {k: {"cpu": 0.0, "wall": 0.0, "tokens": 0, "stats": SpecStats(), "drafter_cpu": 0.0, "mismatches": 0}
             for k in lengths}
    continuations = []
    for prompt in prompts:
        pre = prefill_seconds(core, prompt)
        reference, cpu, wall = timed(lambda p=prompt: plain_greedy(core, p, n_new))
        rows["plain"]["cpu"] += cpu - pre
        rows["plain"]["wall"] += wall - pre
        rows["plain"]["tokens"] += len(reference)
        continuations.append(reference)
        for k in lengths:
            timer = TimedDrafter(drafter)
            out, cpu, wall = timed(lambda p=prompt, k=k, t=timer: greedy_speculative(core, t, p, n_new, k,
                                                                                      stats=rows[k]["stats"]))
            row = rows[k]
            row["cpu"] += cpu - pre
            row["wall"] += wall - pre
            row["tokens"] += len(out)
            row["drafter_cpu"] += timer.seconds
            row["mismatches"] += sum(a != b for a, b in zip(out, reference, strict=True))
    return rows, continuations


@torch.inference_mode()
def draft_outcomes(core, drafter: Drafter, prompts) -> tuple[torch.Tensor, torch.Tensor, float]:
    """At every generated position of each (prompt, plain continuation): hits [n, block] (draft i
    equals the backbone's token) and confidence logits [n, block]; also the drafter's CPU seconds
    per draft pass."""
    hits, confidence, seconds, passes = [], [], 0.0, 0
    for prompt, continuation in prompts:
        tokens = prompt + continuation
        seq, _ = core.new_sequence(tokens, len(tokens) + 1)
        x, pre_mix = core.encode_tokens_batch([seq], [tokens])
        _, states = core.decode_streams_batch([seq], x, pre_mix, [0], [len(tokens)])
        core.release(seq)
        hidden = states[0]
        state = new_state(core.model.config)
        for p in range(len(prompt), len(tokens) - drafter.block - 1):
            t0 = time.process_time()
            drafter.observe(state, hidden[state.length : p])
            draft = drafter.draft([state], [tokens[p]])
            seconds, passes = seconds + time.process_time() - t0, passes + 1
            hits.append(draft.tokens[0] == torch.tensor(tokens[p + 1 : p + 1 + drafter.block]))
            confidence.append(draft.confidence[0])
    return torch.stack(hits), torch.stack(confidence), seconds / max(1, passes)


def by_position(hits: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    reached = torch.cat([torch.ones(len(hits), 1, dtype=torch.bool), hits.cumprod(1)[:, :-1].bool()], dim=1)
    rate = ((hits & reached).sum(0) / reached.sum(0).clamp(min=1)).tolist()
    return [round(r, 4) for r in rate], reached


def calibration(hits, confidence, reached, bins: int = 10) -> list[dict]:
    predicted, observed = torch.sigmoid(confidence[reached]), hits[reached].float()
    rows = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = (predicted >= lo) & ((predicted < hi) if b < bins - 1 else (predicted <= hi))
        if inside.any():
            rows.append({"bin": f"{lo:.1f}-{hi:.1f}", "n": int(inside.sum()),
                         "predicted": round(float(predicted[inside].mean()), 4),
                         "observed": round(float(observed[inside].mean()), 4)})
    return rows


def write_plot(rows: list[dict], path: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        csv = path.with_suffix(".csv")
        csv.write_text("bin,n,predicted,observed\n" + "".join(f"{r['bin']},{r['n']},{r['predicted']},{r['observed']}\n"
                                                               for r in rows))
        return csv
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    ax.plot([r["predicted"] for r in rows], [r["observed"] for r in rows], marker="o", label="DSpark confidence")
    for r in rows:
        ax.annotate(str(r["n"]), (r["predicted"], r["observed"]), fontsize=7, xytext=(3, -9),
                    textcoords="offset points")
    ax.set(xlabel="predicted P(accept | prefix accepted)", ylabel="observed acceptance", xlim=(0, 1), ylim=(0, 1),
           title="DSpark confidence head (held-out text)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@torch.inference_mode()
def cost_curve(core: InferenceCore, prompt: list[int], max_tokens: int, repeats: int = 5) -> dict[int, float]:
    """Median CPU seconds of one verification step of n tokens at batch 1 (rolled back after)."""
    seq, logits = core.prefill(prompt, mode="full", capacity=len(prompt) + max_tokens + 1)
    token = int(logits.argmax())
    curve = {}
    for n in range(1, max_tokens + 1):
        samples = []
        for _ in range(repeats):
            saved = core.checkpoint(seq)
            _, cpu, _ = timed(lambda n=n: core.step(seq, [token] * n))
            core.rollback(seq, saved)
            samples.append(cpu)
        curve[n] = statistics.median(samples)
    core.release(seq)
    return curve


def modelled_schedule(hits, confidence, curve: dict[int, float], draft_s: float, lengths) -> dict:
    """Tokens per CPU second of each length policy over the recorded drafts: each verification of
    k drafts costs the drafter pass and a (k+1)-token step (a rejection cuts that step in place);
    it emits the accepted prefix (up to k) + 1."""
    def rate(choose) -> tuple[float, float]:
        tokens = seconds = 0.0
        for row, conf in zip(hits, confidence, strict=True):
            k = choose(conf)
            accepted = int(row[:k].long().cumprod(0).sum()) if k else 0
            seconds += (draft_s if k else 0.0) + curve[k + 1]
            tokens += accepted + 1
        return tokens / seconds, tokens / len(hits)

    steps_per_s = {n: 1.0 / s for n, s in curve.items()}
    out = {"plain": rate(lambda c: 0)}
    out |= {f"fixed {k}": rate(lambda c, k=k: k) for k in lengths}
    out["auto"] = rate(lambda c: choose_lengths([c.tolist()], lambda n: steps_per_s[n])[0])
    survival = [prefix_survival(c.tolist()) for c in confidence]
    mean_auto = statistics.mean(choose_lengths([c.tolist()], lambda n: steps_per_s[n])[0] for c in confidence)
    return {"tokens_per_cpu_s": {k: round(v[0], 2) for k, v in out.items()},
            "acceptance_length": {k: round(v[1], 3) for k, v in out.items()},
            "auto_mean_length": round(mean_auto, 3),
            "mean_prefix_survival": [round(statistics.mean(s[j] for s in survival), 4)
                                     for j in range(len(survival[0]))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per domain")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = open_model_dir(resolve_model_dir(args.model))
    files = weight_files(model_dir.path)
    if not has_drafter(files):
        raise SystemExit(f"{model_dir.path} holds no DSpark drafter (mtp.*): train one with dsv41 train --dspark")
    model, _ = load_model(model_dir)
    drafter = Drafter(model, load_dspark(model.config, files))
    core = InferenceCore(model)
    prompts = held_out_prompts(Tokenizer.from_file(str(model_dir.tokenizer_path)), args.prompts, args.prompt_len)
    lengths = list(range(1, drafter.block + 1))
    report = {"model": str(model_dir.path), "prompts_per_domain": args.prompts, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "threads": args.threads, "goals": GOALS,
              "batch8": "measured through the pipeline: benchmarks/dspark_pipeline.py", "domains": {}}
    every_hits, every_conf = [], []
    for domain, domain_prompts in prompts.items():
        runs, continuations = decode_runs(core, drafter, domain_prompts, args.new_tokens)
        hits, conf, draft_s = draft_outcomes(core, drafter, list(zip(domain_prompts, continuations, strict=True)))
        every_hits.append(hits)
        every_conf.append(conf)
        base = runs["plain"]["tokens"] / runs["plain"]["cpu"]
        rows = {"plain": {"tokens_per_cpu_s": round(base, 2), "tokens_per_wall_s":
                          round(runs["plain"]["tokens"] / runs["plain"]["wall"], 2)}}
        for k in lengths:
            r = runs[k]
            rows[f"fixed {k}"] = {
                "tokens_per_cpu_s": round(r["tokens"] / r["cpu"], 2),
                "tokens_per_wall_s": round(r["tokens"] / r["wall"], 2),
                "speedup_cpu": round(r["tokens"] / r["cpu"] / base, 3),
                "acceptance_length": round(r["stats"].acceptance_length, 3),
                "drafter_time_share": round(r["drafter_cpu"] / r["cpu"], 3),
                "tokens_differing_from_plain": r["mismatches"]}
        rate, _ = by_position(hits)
        report["domains"][domain] = {"runs": rows, "acceptance_by_position": rate,
                                     "draft_pass_cpu_s": round(draft_s, 5)}
    hits, conf = torch.cat(every_hits), torch.cat(every_conf)
    rate, reached = by_position(hits)
    curve = cost_curve(core, prompts["python"][0], drafter.block + 1)
    draft_s = statistics.mean(d["draft_pass_cpu_s"] for d in report["domains"].values())
    report["acceptance_by_position"] = rate
    report["full_block_acceptance_length"] = round(1 + float(hits.long().cumprod(1).sum(1).float().mean()), 3)
    report["calibration"] = calibration(hits, conf, reached)
    report["verify_cost_cpu_s"] = {n: round(s, 5) for n, s in curve.items()}
    report["scheduler_modelled"] = modelled_schedule(hits, conf, curve, draft_s, lengths)
    report["plot"] = str(write_plot(report["calibration"], RESULTS / "dspark_calibration.png"))
    best = max((report["domains"][d]["runs"][f"fixed {k}"]["speedup_cpu"], d, k)
               for d in report["domains"] for k in lengths)
    measured_al = max(report["domains"][d]["runs"]["fixed 5"]["acceptance_length"] for d in report["domains"])
    report["goals_met"] = {"acceptance_length>=3.0 (fixed 5, best domain)": measured_al >= GOALS["acceptance_length"],
                           "speedup>=2.0x at batch 1 (best)": best[0] >= GOALS["speedup_batch1"]}
    print_table(report, lengths)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dspark.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS / 'dspark.json'} and {report['plot']}")


def print_table(report: dict, lengths) -> None:
    for domain, d in report["domains"].items():
        print(f"\n{domain}: acceptance by draft position {d['acceptance_by_position']}")
        print(f"{'policy':<10}{'tok/CPU s':>11}{'tok/wall s':>12}{'speedup':>9}{'accept len':>12}"
              f"{'drafter share':>15}{'!= plain':>10}")
        for name, r in d["runs"].items():
            print(f"{name:<10}{r['tokens_per_cpu_s']:>11}{r['tokens_per_wall_s']:>12}{r.get('speedup_cpu', 1.0):>9}"
                  f"{r.get('acceptance_length', 1.0):>12}{r.get('drafter_time_share', 0.0):>15}"
                  f"{r.get('tokens_differing_from_plain', 0):>10}")
    s = report["scheduler_modelled"]
    print(f"\nverification cost (CPU s by tokens): {report['verify_cost_cpu_s']}")
    print("modelled from measured pieces (tokens per CPU s / acceptance length):")
    for name, v in s["tokens_per_cpu_s"].items():
        print(f"  {name:<8}{v:>9}{s['acceptance_length'][name]:>8}")
    print(f"  auto chose {s['auto_mean_length']} drafts on average")
    print("\ncalibration (predicted vs observed, positions whose prefix was accepted):")
    for r in report["calibration"]:
        print(f"  {r['bin']:<8} n={r['n']:<6} predicted {r['predicted']:.3f} observed {r['observed']:.3f}")
    print(f"\nbatch 8: {report['batch8']}")
    print(f"goals: {report['goals_met']}")


if __name__ == "__main__":
    main()
