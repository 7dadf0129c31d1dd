"""SmolLM2-135M-Instruct (the real-model fixture, tests/conftest.py): Cadence's loader, model and
chat template compute what transformers computes on a real pretrained checkpoint.

Float32 logits are compared on chat prompts in both of Cadence's layouts (the learner right-pads,
the engine left-pads) against transformers on each prompt alone. TOL is 2e-4, not 1e-4: on this
checkpoint float32 itself is that coarse. Its first token carries a residual of ~2.5e4 (an
attention sink), and transformers' own float32 logits are 6-7e-5 from its float64 ones (Cadence's
8-9e-5, layer by layer ~1e-6 relative for both), so two correct float32 implementations differ by
1.0-1.5e-4 (measured 1.5e-4 max on these prompts; logits reach 39). A wrong detail costs more:
test_a_wrong_norm_eps_is_caught shows an RMSNorm epsilon of 1e-6 instead of 1e-5 moves them by 3e-2.
"""

import dataclasses
import functools
import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402

from cadence.actors.engine import EngineConfig, JaxEngine  # noqa: E402
from cadence.actors.tasks.config import TaskConfig  # noqa: E402
from cadence.actors.tasks.registry import make_task  # noqa: E402
from cadence.launch.config import load_config  # noqa: E402
from cadence.learner.models.policy import build_policy  # noqa: E402
from cadence.learner.models import llama  # noqa: E402
from cadence.learner.models.hf_tokenizer import HFTokenizer  # noqa: E402

TOL = 2e-4
SYSTEM = "Solve the problem. Put the final answer after ####."
CHATS = [
    [{"role": "user", "content": "What is 12 + 30?"}],  # no system message: the template adds its own
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Tom has 3 bags of 4 apples and eats 2. How many apples are left?"}],
]
MORE_CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Écris «3 × 4 = 12»\n\ten une ligne: \\boxed{12} #### 12 <|im_end|>?"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces  \n\n"}],
]


@pytest.fixture(scope="module")
def cadence(smollm2_dir):
    # What `cadence train model.path=DIR` builds: config, weights and tokenizer from the checkpoint.
    policy = build_policy(load_config(overrides=[f"model.path={smollm2_dir}"]))
    assert isinstance(policy.tokenizer, HFTokenizer)
    return policy.model_cfg, policy.graphdef, policy.params, policy.tokenizer


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(smollm2_dir)


def test_checkpoint_loads_as_smollm2_135m(cadence, smollm2_dir):
    cfg, _, params, tok = cadence
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_embeddings and "lm_head" not in params
    assert llama.count_params(params) == 134_515_008
    assert cfg.param_dtype == "float32" and params["embed_tokens"]["embedding"][...].dtype == np.float32
    # EOS is ChatML's end of turn, which also pads; BOS is <|im_start|> (the template writes it).
    assert tok.eos_ids == (2,) and tok.eos_id == tok.pad_id == tok.encode("<|im_end|>")[0] == 2
    assert tok.bos_id == tok.encode("<|im_start|>")[0] == 1
    marker = json.loads((pathlib.Path(smollm2_dir) / ".cadence-prepared.json").read_text())
    assert marker["params"] == 134_515_008


def _reference(model, rows):
    """transformers' float32 logits of each row alone (no padding involved)."""
    with torch.no_grad():
        return [model(torch.tensor([row])).logits[0].numpy() for row in rows]


def _layouts(rows, pad_id):
    """The learner's layout (right-padded, positions arange) and the engine's (left-padded,
    positions counting real tokens), stacked as one batch of 2 * len(rows)."""
    t = max(map(len, rows))
    tokens = np.full((2 * len(rows), t), pad_id, np.int32)
    mask = np.zeros(tokens.shape, bool)
    for i, row in enumerate(rows):
        tokens[i, :len(row)], mask[i, :len(row)] = row, True
        tokens[len(rows) + i, t - len(row):], mask[len(rows) + i, t - len(row):] = row, True
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int32)
    return tokens, positions, mask


def _max_diff(cfg_params, rows, refs):
    _, graphdef, params = cfg_params
    tokens, positions, mask = _layouts(rows, pad_id=2)
    logits = np.asarray(jax.jit(functools.partial(llama.forward, graphdef))(params, tokens, positions, mask))
    diffs, argmax_equal = [], True
    for i, ref in enumerate(refs * 2):
        ours = logits[i][mask[i]]
        diffs.append(float(np.abs(ours - ref).max()))
        argmax_equal &= bool((ours.argmax(-1) == ref.argmax(-1)).all())
    return max(diffs), argmax_equal


@pytest.fixture(scope="module")
def chat_rows(cadence, hf):
    """CHATS through Cadence's chat template, and transformers' logits of each."""
    rows = [cadence[3].apply_chat_template(chat) for chat in CHATS]
    return rows, _reference(hf[0], rows)


def test_fp32_logits_match_transformers_on_chat_prompts(cadence, chat_rows):
    cfg, graphdef, params, _ = cadence
    rows, refs = chat_rows
    assert len(rows[0]) != len(rows[1])  # so both layouts really pad
    diff, argmax_equal = _max_diff((cfg, graphdef, params), rows, refs)
    print(f"smollm2 fp32 max |logit diff| = {diff:.3g}")
    assert diff <= TOL
    assert argmax_equal


@pytest.mark.slow  # a second compile of the 30-layer model, for a check of the test itself
def test_a_wrong_norm_eps_is_caught(cadence, chat_rows):
    # The tolerance still tells a wrong detail apart: norm_eps 1e-6 (Qwen's) instead of the 1e-5
    # here moves the logits by ~3e-2, 150x TOL.
    cfg, _, params, _ = cadence
    wrong = dataclasses.replace(cfg, norm_eps=1e-6)
    diff, _ = _max_diff((wrong, llama.abstract_params(wrong)[0], params), *chat_rows)
    print(f"smollm2 fp32 max |logit diff| with norm_eps 1e-6 = {diff:.3g}")
    assert diff > TOL


@pytest.mark.parametrize("chat", CHATS + MORE_CHATS)
def test_chat_template_matches_transformers(cadence, hf, chat):
    tok, hf_tok = cadence[3], hf[1]
    for generation_prompt in (True, False):
        ref = hf_tok.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=True,
                                         return_dict=False)
        assert tok.apply_chat_template(chat, add_generation_prompt=generation_prompt) == list(ref)
        assert tok.render_chat(chat, generation_prompt) == hf_tok.apply_chat_template(
            chat, add_generation_prompt=generation_prompt, tokenize=False)


def test_chat_format_task_prompts_are_the_templates(cadence, hf, tmp_path):
    # What a run with task.format=chat feeds the model: the jsonl task's prompts, rendered by the
    # checkpoint's template exactly as transformers renders them (with and without a system prompt).
    tok, hf_tok = cadence[3], hf[1]
    questions = ["What is 12 + 30?", "A book costs $7. How much do 3 books cost?", "Compute 1/2 + 1/4."]
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": f"#### {i}"}) + "\n" for i, q in enumerate(questions)))
    for system in ("", SYSTEM):
        cfg = TaskConfig(name="jsonl", path=str(path), format="chat", system_prompt=system, heldout_size=2,
                         prompt_template="Question: {prompt}", reward_workers=0)
        task = make_task(cfg, tok)
        for prompt in [*task.heldout(), task.prompt(0)]:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": f"Question: {prompt.text}"}]
            ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            assert list(prompt.tokens) == list(ref)
            assert hf_tok.decode(prompt.tokens).endswith("<|im_start|>assistant\n")


@pytest.mark.slow  # the engine's prefill and decode compile for 30 layers (~30 s on 2 cores)
def test_greedy_generation_matches_transformers_generate(cadence, hf):
    # The engine's KV-cache path at this size (GQA 9/3, left-padded batch, stop at <|im_end|>).
    # Greedy decoding can flip at a near-tie of two logits; these prompts have none in 40 tokens.
    cfg, graphdef, params, tok = cadence
    prompts = [tok.apply_chat_template(chat) for chat in CHATS]
    engine = JaxEngine(cfg, graphdef, EngineConfig(max_new_tokens=40, batch_buckets=(2,)), tok.eos_id, tok.pad_id)
    result = engine.generate(params, prompts, jax.random.key(0), greedy=True)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf[0].generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
        assert result.tokens[row, : int(result.lengths[row])].tolist() == out[0, len(prompt):].tolist()
    assert result.tokens[0, int(result.lengths[0]) - 1] == tok.eos_id  # "12 + 30 = 32 ... <|im_end|>"
