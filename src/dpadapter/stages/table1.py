"""The DPAdapter paper's Table 1 question, per algorithm: does DPAdapter help it here?

The paper (shared/papers/dpadapter.txt, Table 1) fine-tunes with four DP algorithms from four
upstreams on three private tasks at ε = 1 and 4; its claim is the gain of DPAdapter over
standard pre-training, which it reports per algorithm. Our paired comparisons
(`stages.paired`) measure the same differences on our tasks, pooled over tasks, ε and seeds
with an interval and the smallest difference the design detects. This module puts the paper's
difference for the same comparison beside ours and answers the question in one line per
algorithm, so a reader sees at once whether a gap to the paper is a finding (the interval
excludes the paper's effect) or a lack of power (the interval holds both it and zero).

The paper's numbers are typed in once below (its Table 1, accuracy as fractions, columns
CIFAR-10 ε=1, ε=4, SVHN ε=1, ε=4, STL-10 ε=1, ε=4, then its printed Average ε=1, ε=4); its
effects are computed from them, as the differences of its printed averages (what a reader of
the paper computes, and the figures its text quotes), never typed in themselves.
"""

from __future__ import annotations

import statistics

# Table 1 of the DPAdapter paper as printed, a row per algorithm and upstream (our names)
_PAPER_TEXT = """
dpsgd    scratch   0.4288 0.5070 0.7194 0.8380 0.2831 0.3370 0.4771 0.5607
dpsgd    standard  0.5928 0.7210 0.7822 0.8970 0.3282 0.5695 0.5677 0.7292
dpsgd    sam       0.6216 0.7650 0.8042 0.9014 0.3625 0.6212 0.5961 0.7625
dpsgd    dpadapter 0.6416 0.7746 0.8058 0.9018 0.3951 0.6364 0.6142 0.7709
adpclip  scratch   0.3738 0.5348 0.6258 0.8294 0.2270 0.3543 0.4089 0.5728
adpclip  standard  0.4198 0.6780 0.6196 0.8914 0.2406 0.4890 0.4267 0.6861
adpclip  sam       0.5962 0.7108 0.6672 0.8962 0.2539 0.5446 0.5058 0.7172
adpclip  dpadapter 0.6008 0.7186 0.6730 0.9012 0.3023 0.5676 0.5254 0.7291
gep      scratch   0.4008 0.4672 0.5892 0.8158 0.2360 0.3239 0.4087 0.5356
gep      standard  0.6512 0.7456 0.8078 0.8500 0.3326 0.6002 0.5972 0.7319
gep      sam       0.6808 0.7472 0.8132 0.8538 0.3739 0.6168 0.6226 0.7393
gep      dpadapter 0.6890 0.7692 0.8180 0.8686 0.4730 0.6462 0.6600 0.7613
adpalloc scratch   0.4370 0.5166 0.6248 0.7678 0.2923 0.3391 0.4514 0.5412
adpalloc standard  0.4506 0.6982 0.6604 0.8938 0.2946 0.5104 0.4685 0.7008
adpalloc sam       0.5296 0.7372 0.7652 0.8998 0.2933 0.5675 0.5294 0.7348
adpalloc dpadapter 0.5352 0.7406 0.7862 0.9008 0.2938 0.6111 0.5384 0.7508
"""
PAPER_TABLE1: dict[str, dict[str, tuple[float, ...]]] = {}
for _row in _PAPER_TEXT.split("\n")[1:-1]:
    _algo, _up, *_cells = _row.split()
    PAPER_TABLE1.setdefault(_algo, {})[_up] = tuple(float(v) for v in _cells)
PAPER_EPSILONS = (1.0, 4.0)  # the column pairs of each task, in this order
PAPER_TASKS = 3  # CIFAR-10, SVHN, STL-10; then the Average pair
# Table 1's comparisons, the question first; the control is ours (the paper has none)
QUESTIONS = (("dpadapter", "standard"), ("sam", "standard"), ("dpadapter", "control"))
NAMES = {
    "dpsgd": "DP-SGD",
    "adpclip": "AdpClip",
    "gep": "GEP",
    "adpalloc": "AdpAlloc",
    "dpsat": "DP-SAT",
    "dpsam": "DP-SAM",
}


def paper_effect(algorithm: str, a: str, b: str) -> dict[float | str, float] | None:
    """`a` − `b` in the paper's Table 1: per ε the difference of its printed averages, and their
    mean (`"mean"`, what our pooled estimate over ε estimates); None where the paper has none."""
    rows = PAPER_TABLE1.get(algorithm, {})
    if a not in rows or b not in rows:
        return None
    avg = PAPER_TASKS * len(PAPER_EPSILONS)  # where the printed Average columns start
    out: dict[float | str, float] = {}
    for i, eps in enumerate(PAPER_EPSILONS):
        out[eps] = rows[a][avg + i] - rows[b][avg + i]
    out["mean"] = statistics.fmean(out[e] for e in PAPER_EPSILONS)
    return out


def _pts(v: float) -> str:
    return f"{100 * v:+.1f}"


def _interval(c: dict) -> str:
    p = c["pooled"]
    return f"{_pts(p['estimate'])} [{_pts(p['low'])}, {_pts(p['high'])}]"


def verdict(algorithm: str, comps: dict[tuple[str, str], dict]) -> str:
    """One line: does DPAdapter help `algorithm` here (DPAdapter − standard, then whether the
    compute-matched control explains it), beside the paper's effect."""
    main = comps.get(("dpadapter", "standard"))
    if main is None or main.get("pooled") is None:
        return "not testable here (no paired seeds of DPAdapter and standard pre-training)"
    p = main["pooled"]
    paper = paper_effect(algorithm, "dpadapter", "standard")
    said = f"DPAdapter − standard {_interval(main)} points"
    if paper is not None:
        pe = paper["mean"]
        where = (
            "above our interval"
            if pe > p["high"]
            else "below our interval"
            if pe < p["low"]
            else "inside our interval"
        )
        said += f" (paper {_pts(pe)}, {where})"
    if p["low"] > 0:
        answer = f"**yes**: {said}"
        ctl = comps.get(("dpadapter", "control"))
        if ctl is not None and ctl.get("pooled") is not None:
            c = ctl["pooled"]
            if c["low"] > 0:
                answer += f", and beyond the compute-matched control ({_interval(ctl)})"
            elif c["high"] < 0:
                answer += (
                    f", but the compute-matched control does better ({_interval(ctl)}): the "
                    "gain is the extra training, not DPAdapter"
                )
            else:
                answer += (
                    f", not told apart from the compute-matched control ({_interval(ctl)}): "
                    "extra training may explain it"
                )
        else:
            answer += "; no compute-matched control ran, so extra training may explain it"
        return answer
    if p["high"] < 0:
        return f"**no, it hurts**: {said}"
    det = main.get("detectable")
    power = f"; the design detects ±{100 * det:.1f}" if det else ""
    return f"**not detectably**: {said}{power}"


def markdown(result: dict, algorithms: list[str] | None = None) -> str:
    """The section under the paired differences: per algorithm, Table 1's comparisons pooled
    (ours) beside the paper's, and the answer. `result`: `paired.analyse`'s; `algorithms`: the
    order of the blocks (the table's), others after it."""
    by: dict[str, dict[tuple[str, str], dict]] = {}
    for c in result["comparisons"]:
        by.setdefault(c["algorithm"], {})[(c["upstream"], c["versus"])] = c
    present = [a for a in by if any(q in by[a] for q in QUESTIONS)]
    if not present:
        return ""
    order = [a for a in algorithms or [] if a in present] + sorted(
        a for a in present if a not in (algorithms or [])
    )
    lines = [
        "",
        "### Does DPAdapter help each algorithm here? (the paper's Table 1 question)",
        "",
        "Ours: the pooled paired difference over tasks, ε and seeds (as above), in points, its "
        "95 % interval and the smallest difference detected with "
        f"{result['power']:.0%} power. Paper: the same difference of its Table 1's averages "
        "over CIFAR-10, SVHN and STL-10, at ε = 1, ε = 4 and their mean (what our pooled "
        "estimate compares with); the paper has no compute-matched control.",
        "",
        "| algorithm | comparison | ours [95 % CI] | detectable | paper ε=1 | paper ε=4 "
        "| paper mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for algo in order:
        for a, b in QUESTIONS:
            c = by[algo].get((a, b))
            if c is None:
                continue
            ours = _interval(c) if c.get("pooled") else "n/a"
            det = f"±{100 * c['detectable']:.1f}" if c.get("detectable") else "n/a"
            paper = paper_effect(algo, a, b)
            cols = (
                [_pts(paper[e]) for e in PAPER_EPSILONS] + [_pts(paper["mean"])]
                if paper
                else ["–"] * (len(PAPER_EPSILONS) + 1)
            )
            name = NAMES.get(algo, algo)
            lines.append(f"| {name} | {a} − {b} | {ours} | {det} | " + " | ".join(cols) + " |")
    lines.append("")
    for algo in order:
        lines.append(f"- {NAMES.get(algo, algo)}: {verdict(algo, by[algo])}.")
    return "\n".join(lines) + "\n"
