"""Held-out evaluation of a config's policy, or of a run's trained params: `cadence eval` and
`cadence.evaluate`.

    cfg = cadence.load_config(["runs/NAME/config.yaml"])
    result = cadence.evaluate(cfg, "runs/NAME")          # run_dir=None: the config's own weights
    result.metrics["eval/exact_match"], result.completions[0].text, result.scores[0].reward

Greedy decoding of the task's held-out prompts with the built-in engine, scored as the run scores
(its reward workers, servers and limits), exactly what a run logs as eval/*.
"""
from __future__ import annotations

from cadence.actors.evaluation import Heldout, heldout_results


def evaluate(cfg, run_dir: str | None = None, *, limit: int | None = None) -> Heldout:
    """cfg: a loaded Config. run_dir: a run whose trained params to evaluate (FileNotFoundError if
    it has none); None evaluates the config's policy as built (model.path's weights, or random).
    limit: only the first N held-out prompts."""
    from cadence.actors.engine import JaxEngine
    from cadence.actors.rewards import make_scorer
    from cadence.actors.tasks.registry import make_task
    from cadence.launch import artifacts
    from cadence.learner.models.policy import build_policy

    policy = build_policy(cfg)  # the same model config and tokenizer the run trained with
    params = artifacts.load_params(run_dir, policy.params) if run_dir else policy.params
    tok = policy.tokenizer
    engine = JaxEngine(policy.model_cfg, policy.graphdef, cfg.engine, tok.eos_id, tok.pad_id)
    task = make_task(cfg.task, tok)
    scorer = make_scorer(cfg.task, task, tok)  # the run's rewards, with its time and memory limits
    try:
        return heldout_results(engine, task, params, task.heldout()[:limit], scorer)
    finally:
        scorer.close()
