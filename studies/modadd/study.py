"""The modular-addition robustness study (arXiv 2601.04283): the committed study grids and the
runner.

A study (`config.StudyConfig`) is configurations x seeds with one per-run budget. `run_study`
trains each run (`training.train_run`) and writes `runs/<name>.json` atomically when it
finishes; a restart skips every run whose file parses and carries the same config, so a crash
loses at most the run in progress; `shard=(i, n)` splits a study over n processes. Then
`aggregate.aggregate` writes `table.md`, `table.json`, `shift.png` and `ablation.png` from the
run files alone.

`STUDY_PRESETS` are the committed studies (`lcx train modadd --study --config NAME`): `default`
is the paper's grid (`config.STUDY_CONFIGS` x 3 seeds), each other one asks one question about
the full recipe (the comment above it); every `budget_note` is written into the study's
`study_config.json`. What each found is in docs/studies.md ("Modular-addition study"), and
its files are in `results/modadd/` (`default`) or `results/modadd/<name>/`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from lcx.data.io import atomic_write_json, environment

from .aggregate import aggregate
from .config import StudyConfig, load_run
from .training import train_run


def run_study(study: StudyConfig, out: str | Path, *, progress: bool = True, only_missing: bool = True,
              log=print, shard: tuple[int, int] = (0, 1)) -> list[dict[str, Any]]:
    """Run every configuration x seed not already finished in `<out>/runs/`, then aggregate.

    `shard=(i, n)` runs only every n-th run starting at i, so n processes (one per core) can
    share a study: each run has its own file, so shards never collide.
    """
    i_shard, n_shard = shard
    if not 0 <= i_shard < n_shard:
        raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard}")
    from tqdm.auto import tqdm

    out = Path(out)
    runs_dir = out / "runs"
    env = environment()
    atomic_write_json(out / "study_config.json", {"study": study.to_dict(), "environment": env})
    cfgs = study.run_configs()[i_shard::n_shard]
    results = []
    bar = tqdm(cfgs, disable=not progress, desc="study", unit="run", dynamic_ncols=True)
    for cfg in bar:
        path = runs_dir / f"{cfg.name}.json"
        done = load_run(path, cfg) if only_missing else None
        if done is not None:
            results.append(done)
            continue
        bar.set_postfix_str(cfg.name, refresh=True)
        _, res = train_run(cfg, progress=progress)
        res["environment"] = env
        atomic_write_json(path, res)
        m = res["metrics"]
        log(f"{cfg.name}: id {m['id']:.3f} pos {m['pos']:.3f} template {m['template']:.3f} "
            f"({res['train_s']:.0f}s train)")
        results.append(res)
    bar.close()
    aggregate(out, study)
    return results


# The committed study: every run gets these settings (see StudyConfig.budget_note for why).
DEFAULT_STUDY = StudyConfig(
    run={"steps": 1000, "batch_size": 256, "eval_pairs": 500, "eval_offsets": [0, 4, 8, 16, 24, 32, 48, 64, 128]},
    budget_note=("1000 AdamW steps x 256 sequences per run (256k examples; with the consistency loss 128 pairs "
                 "rendered twice), one thread per run, two runs at a time (--shard 0/2, 1/2): sized so that "
                 "the 45 runs take about an hour on 2 CPU cores. The baseline converges well within it; the "
                 "robust recipe does not (probes: ~25% held-out at 1000-1500 steps, with training pairs at "
                 "~43%, i.e. still memorising), so robust numbers are at an equal, not a converged, budget. "
                 "Accuracy on the first 500 held-out pairs per split."),
)

# The budget check: the default study at 4x its steps, one seed.
LONG_STUDY = StudyConfig(
    configs=(("baseline", "learned"), ("robust", "learned"), ("robust_nl", "learned"), ("robust", "rope")),
    seeds=(0,),
    run={**DEFAULT_STUDY.run, "steps": 4000},
    budget_note=("The budget check for the default study: 4x its steps (4000 x 256 sequences), one seed: "
                 "the baseline, the robust recipe (learned and RoPE positions) and robust_nl (natural-language "
                 "phrasings in the template mixture). About 35 min on 2 CPU cores (--shard 0/2, 1/2). "
                 "Accuracy on the first 500 held-out pairs."),
)

# Why does the full recipe learn so slowly? The reference curves, then `robust` with one
# scheduling or optimisation choice changed at a time (learning curves every 100 steps).
DIAGNOSIS_STUDY = StudyConfig(
    configs=(
        ("baseline", "learned"), ("baseline+curriculum", "learned"), ("robust", "learned"),
        ("robust-no_consistency", "learned"), ("robust-no_curriculum", "learned"),
        ("robust~offset_sampling=example", "learned"),
        ("robust~curriculum_delay_frac=0.2", "learned"),
        ("robust~consistency_ramp_frac=0.5", "learned"),
        ("robust", "learned", {"tag": "lr3e-3", "lr": 3e-3}),
        ("robust", "learned", {"tag": "wd0.1", "weight_decay": 0.1}),
    ),
    seeds=(0,),
    run={**DEFAULT_STUDY.run, "eval_every": 100},
    budget_note=("Diagnosis of the full recipe's slow learning: the default study's budget (1000 x 256), one "
                 "seed, learning curves every 100 steps on 200 held-out pairs (curve_metrics); each variant "
                 "changes one scheduling or optimisation choice of `robust`."),
)

# Staged recipes: the task on the canonical template at offset 0 first, then offsets and the
# mixed template pool; with and without the strong weight decay.
STAGED_STUDY = StudyConfig(
    configs=(
        ("robust_nl~template_delay_frac=0.4~curriculum_delay_frac=0.4", "learned"),
        ("robust_nl~template_delay_frac=0.4~curriculum_delay_frac=0.4", "learned", {"tag": "wd0.1", "weight_decay": 0.1}),
    ),
    seeds=(0,),
    run={**DEFAULT_STUDY.run, "eval_every": 100},
    budget_note=("Staged recipes (canonical first, then offsets and the mixed template pool) at the default "
                 "study's budget, one seed, learning curves every 100 steps."),
)

# Does a position table that starts with relative structure (sinusoidal init, still learned)
# let shifted inputs reuse what was learned at offset 0?
SINUSOIDAL_STUDY = StudyConfig(
    configs=(
        ("baseline+curriculum", "learned", {"tag": "sin", "model": {"position_init": "sinusoidal"}}),
        ("robust_nl", "learned", {"tag": "sin", "model": {"position_init": "sinusoidal"}}),
    ),
    seeds=(0,),
    run={**DEFAULT_STUDY.run, "eval_every": 100},
    budget_note=("Learned positions initialised with the sinusoidal table (EncoderConfig.position_init), "
                 "at the default study's budget, one seed, learning curves every 100 steps."),
)

# Is it the budget? robust_nl at 8x the default steps.
BUDGET_STUDY = StudyConfig(
    configs=(("robust_nl", "learned"),),
    seeds=(0,),
    run={**DEFAULT_STUDY.run, "steps": 8000, "eval_every": 500},
    budget_note=("robust_nl at 8x the default study's steps (8000 x 256 sequences), one seed, learning "
                 "curves every 500 steps: does the combined recipe converge given the budget?"),
)

# Is it depth? robust_nl on a 4-layer encoder (the paper's has 2): a diagnosis, not the reproduction.
CAPACITY_STUDY = StudyConfig(
    configs=(("robust_nl", "learned", {"tag": "L4", "model": {"n_layers": 4}}),),
    seeds=(0,),
    run={**DEFAULT_STUDY.run, "steps": 2000, "eval_every": 250},
    budget_note=("Depth check for the full recipe's plateau: robust_nl on a 4-layer encoder (the paper's has 2), "
                 "2000 x 256 sequences, one seed, learning curves every 250 steps."),
)

# What is the ~25% plateau? robust_nl with one regularisation, loss or initialisation choice
# changed; every run file records its place-value errors (`evaluation.place_value_errors`).
PLACE_VALUE_STUDY = StudyConfig(
    configs=(("robust_nl", "learned", {"tag": "wd0.1", "weight_decay": 0.1}),
             ("robust_nl", "learned", {"tag": "nopd", "position_decay": False}),
             ("robust_nl", "learned", {"tag": "sin_nopd", "position_decay": False,
                                       "model": {"position_init": "sinusoidal"}}),
             ("robust_nl-no_consistency", "learned")),
    seeds=(0,),
    run={**DEFAULT_STUDY.run, "steps": 3000, "eval_every": 250},
    budget_note=("The plateau's cause: robust_nl at 3000 x 256 sequences, one seed, learning curves every 250 "
                 "steps, with one regularisation, loss or initialisation choice changed; place-value errors per run."),
)

# Does a dense local signal teach the digit order? robust_nl + the auxiliary masked-character
# loss (`RunConfig.mlm_weight`), one seed: a screen.
MLM_STUDY = StudyConfig(
    configs=(("robust_nl", "learned", {"tag": "mlm", "mlm_weight": 1.0}),),
    seeds=(0,),
    run={**DEFAULT_STUDY.run, "steps": 3000, "eval_every": 250},
    budget_note=("robust_nl + the auxiliary masked-character loss (weight 1, rate 0.15), learned positions, "
                 "3000 x 256 sequences, one seed, learning curves every 250 steps."),
)

# robust_staged (RECIPES): the curriculum first, templates and consistency from the middle.
# 5000 x 256 sequences: offset 0 for 500 steps, offsets widening to 32 by step 3000, the
# template mixture and the consistency loss from step 2500 on.
STAGED_CURRICULUM_STUDY = StudyConfig(
    configs=(("robust_staged", "learned"),),
    seeds=(0, 1, 2, 3, 4),
    run={**DEFAULT_STUDY.run, "steps": 5000, "eval_every": 250},
    budget_note=("robust_staged, learned positions, 5000 x 256 sequences, five seeds (seeds 3 and 4 added "
                 "after the first three), learning curves every 250 steps."),
)
# The same at 3000 steps (where the recipe was found; the second stage then has 1500 steps).
STAGED_CURRICULUM_SHORT_STUDY = dataclasses.replace(
    STAGED_CURRICULUM_STUDY, seeds=(0, 1, 2), run={**STAGED_CURRICULUM_STUDY.run, "steps": 3000},
    budget_note="robust_staged, learned positions, 3000 x 256 sequences, three seeds, curves every 250 steps.")
# robust_staged without its offset-0 start (the recipe's first version), 3000 steps.
STAGED_NODELAY_STUDY = StudyConfig(
    configs=(("robust_staged~curriculum_delay_frac=0", "learned"),),
    seeds=(0,),
    run=STAGED_CURRICULUM_SHORT_STUDY.run,
    budget_note="robust_staged without its offset-0 start, 3000 steps, seed 0 (seed 1 was stopped on the plateau).",
)

# `--config NAME` picks one of these; `--config FILE.json` reads a StudyConfig. Default output
# directory: results/modadd for `default`, results/modadd/<name> for the others.
STUDY_PRESETS: dict[str, StudyConfig] = {"default": DEFAULT_STUDY, "long": LONG_STUDY,
                                          "diagnosis": DIAGNOSIS_STUDY, "staged": STAGED_STUDY,
                                          "sinusoidal": SINUSOIDAL_STUDY, "budget": BUDGET_STUDY,
                                          "capacity": CAPACITY_STUDY, "placevalue": PLACE_VALUE_STUDY,
                                          "mlm": MLM_STUDY, "curriculum_first": STAGED_CURRICULUM_STUDY,
                                          "curriculum_first_short": STAGED_CURRICULUM_SHORT_STUDY,
                                          "curriculum_first_nodelay": STAGED_NODELAY_STUDY}
