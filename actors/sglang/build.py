"""An SGLang engine for a policy: the servers, exports and weight syncs of cfg.actors.sglang.

Used where actors run (the learner's actor threads, or one actor process)."""
from __future__ import annotations


def sglang_engine(cfg, policy, work_dir: str, fetch=None):
    """SGLang servers serving this policy (actor threads in the learner, or one actor process):
    cfg.actors.sglang's servers, exports and syncs in work_dir. fetch: whole copies of some param
    arrays of a sharded learner (exports and sync buckets)."""
    from cadence.actors.sglang.checkpoint import export_for_server
    from cadence.actors.sglang.engine import SGLangEngine
    from cadence.learner.models.hf_export import hf_tensors

    return SGLangEngine(cfg.actors.sglang, max_new_tokens=cfg.engine.max_new_tokens,
                        eos_id=policy.tokenizer.eos_id, pad_id=policy.tokenizer.pad_id,
                        temperature=cfg.engine.temperature, top_p=cfg.engine.top_p, work_dir=work_dir,
                        export_fn=lambda params, d: export_for_server(policy.model_cfg, params, d, fetch=fetch),
                        tensors_fn=lambda params: hf_tensors(policy.model_cfg, params), gather_fn=fetch)
