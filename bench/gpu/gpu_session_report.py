"""summary.md of the GPU session: what a person reads first, every figure with where it ran."""

from __future__ import annotations


def _versions(v: dict) -> list[str]:
    card = v.get("card") or v.get("smi_card") or f"no GPU ({v.get('cpu')}, {v.get('cpus')} CPUs)"
    mem = f", {v['memory_gib']} GiB" if v.get("memory_gib") else ""
    return [
        f"- card: **{card}**{mem}, driver {v.get('driver')}, host {v.get('host')}",
        f"- torch {v.get('torch')}, CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}, "
        f"Python {v.get('python')}",
        f"- Opacus {v.get('opacus')}, timm {v.get('timm')}, dp-accounting "
        f"{v.get('dp-accounting')}, Snakemake {v.get('snakemake')}, MLflow {v.get('mlflow')}",
    ]


def _smoke(smoke: dict | None) -> list[str]:
    if not smoke:
        return ["No report (the step did not start or wrote nothing)."]
    runs, bad = smoke.get("runs", {}), smoke.get("failures", {})
    lines = [
        f"{len(runs)} runs, {len(bad)} with a failed check"
        + ("" if smoke.get("done") else " (the step was cut: the list is what finished)")
        + ":"
    ]
    for k, r in runs.items():
        acc = r.get("accuracy")
        extra = f", accuracy {acc:.3f}" if isinstance(acc, float) else ""
        extra += f", {r['wall_s']} s" if "wall_s" in r else ""
        lines.append(f"- {k}: {'FAILED ' + str(bad[k]) if k in bad else 'ok'}{extra}")
    for k in bad:
        if k not in runs:
            lines.append(f"- {k}: {bad[k]}")
    return lines


def _pipeline(p: dict | None) -> list[str]:
    if not p:
        return ["Not run."]
    jobs = p.get("training_jobs", [])
    forked = sum(j["forked"] for j in jobs)
    devices = sorted({str(j["device"]) for j in jobs})
    verdict = "ok" if p.get("ok") else "NOT SHOWN"
    lines = [
        f"{verdict}: {len(jobs)} training jobs on {devices}, {forked} of them in the fork "
        f"server's children ({p.get('forked_jobs')} forked in all)."
    ]
    for r in p.get("refused", []):
        lines.append(f"- the server refused a job: {r}")
    return lines


def _table2(t: dict | None) -> list[str]:
    if not t:
        return ["Not run."]
    if "error" in t:
        return [f"The step broke: `{t['error']}` (logs.txt)."]
    before = t.get("done_before") or []
    lines = [
        f"Mode **{t.get('mode')}** ({t.get('mode_reason')}), {t.get('parallel')} cells side "
        f"by side, config `{t.get('config')}`. Finished in earlier loans and skipped "
        f"({len(before)}, `{t.get('done_from')}`): {', '.join(before) or 'none'}. "
        f"Not started in this call: {t.get('not_started', 0)} (the next shown below).",
        "",
        t.get("table", ""),
    ]
    for k, c in t.get("cells", {}).items():
        if c.get("accuracy") is not None and c.get("paper"):
            mean, std = c["paper"]
            gap = c["accuracy"] - mean
            flag = " — more than 2 points below the paper: investigate" if gap < -2 else ""
            lines.append(
                f"- {k}: {c['accuracy']:.2f} vs paper {mean:.2f} ± {std:.2f} "
                f"({gap:+.2f}){flag}; ε spent {c['epsilon_spent']:.3f}, {c['steps']} steps"
            )
        elif c.get("status") != "passed":
            lines.append(f"- {k}: **{c.get('status')}**, {c.get('note')} (no result)")
    return lines


def _options(data: dict) -> str:
    """The command's options as given (a rerun with --only says so), closing the backquote."""
    opts, skip = [], False
    for o in data.get("options") or []:
        if skip or o in ("--out", "--work"):  # where files went, not what ran
            skip = not skip
            continue
        opts.append(o)
    return (" " + " ".join(opts) if opts else "") + "`"


def render(data: dict, outcomes: list) -> str:
    dry = data.get("dry_run")
    title = "GPU session — DRY RUN on the CPU (tiny sizes: no figure here means anything)"
    lines = [
        f"# {title if dry else 'GPU session'}",
        "",
        f"Deadline {data.get('deadline_s'):.0f} s, used {data.get('elapsed_s')} s. "
        "Command: `bash bench/gpu/gpu_session.sh"
        + (" --dry-run OUTDIR`" if dry else _options(data)),
        "",
        "| step | status | wall s | note |",
        "|---|---|---|---|",
    ]
    lines += [f"| {o.name} | {o.status} | {o.wall_s} | {o.note} |" for o in outcomes]
    lines += ["", "## a. Versions and card", "", *_versions(data.get("versions") or {})]
    lines += ["", "## b. DP step / non-private step, peak memory, clipped sums in float64", ""]
    dpm = data.get("dp_modes")
    if dpm:
        from dp_modes import markdown

        lines.append(markdown(dpm))
        if not dpm.get("done"):
            lines.append("(cut before every model was measured)")
    else:
        lines.append("No measurement (see logs.txt).")
    lines += ["", "## s. Per-sample self-test at Table 2's batch, each module's worst example", ""]
    st = data.get("self_test")
    if st:
        from gpu_self_test import summary

        lines += [f"{st['examples']} examples, GNResNet-10 seed {st['model']['seed']} "
                  "(self_test.json has every module):", "", "```", summary(st), "```"]  # fmt: skip
    else:
        lines.append("Not run (see logs.txt).")
    lines += ["", "Compiled (`finetune.compile`, run after d): bk and the non-private step through "
              "torch.compile, ratios against the eager non-private step", ""]  # fmt: skip
    dpc = data.get("dp_compiled")
    if dpc:
        from dp_modes import markdown

        lines.append(markdown(dpc))
        if not dpc.get("done"):
            lines.append("(cut before every model was measured)")
    else:
        lines.append("No measurement (see logs.txt).")
    lines += ["", "## c. CUDA smoke of every algorithm x mode, upstream, external ViT", ""]
    lines += _smoke(data.get("smoke"))
    tests = data.get("cuda_tests")
    lines += ["", "CUDA-only tests of the suite: " + (
        f"{tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
        f"{tests['skipped']} skipped" if tests else "no report")]  # fmt: skip
    lines += ["", "## d. Tiny pipeline through Snakemake and the fork server", ""]
    lines += _pipeline(data.get("pipeline"))
    lines += ["", "## e. DP-SAT Table 2, Fashion-MNIST, GNResNet-10 from scratch", ""]
    lines += _table2(data.get("table2"))
    lines += [
        "",
        "Files: session.json (everything above as data), dp_modes.md, self_test.json, "
        "gpu_smoke.json, table2.md, logs.txt (the end of every step's log), "
        "artifacts.tar.gz (every log, JSON and table the steps wrote).",
    ]
    return "\n".join(lines) + "\n"
