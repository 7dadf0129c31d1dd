"""An engine that answers every prompt with fixed token ids, for tests where the engine is not
under test (the reward path, the verifier)."""
import numpy as np

from cadence.actors.engine_api import Engine, GenerationResult


class ScriptedEngine(Engine):
    """Row i of a call answers with rows[i % len(rows)]; log-probs are 0. Holds no weights."""

    name = "scripted"
    holds_weights = False

    def __init__(self, rows):
        self.rows = rows

    def generate(self, params, prompts, key, greedy=False, temperature=None, top_p=None, stop=()):
        n, m = len(prompts), max(len(r) for r in self.rows)
        tokens = np.zeros((n, m), np.int32)
        lengths = np.zeros((n,), np.int32)
        for i in range(n):
            row = self.rows[i % len(self.rows)]
            tokens[i, :len(row)], lengths[i] = row, len(row)
        return GenerationResult(tokens, np.zeros((n, m), np.float32), lengths, 0.0, int(lengths.sum()))

    def sync_weights(self, params, version, min_version=None):
        return False

    def forget_weights(self):
        pass

    def counters(self):
        return {}

    def abort(self):
        pass

    def close(self):
        pass
