"""An engine that answers every prompt with fixed token ids, for tests where the engine is not
under test (the reward path, the verifier)."""
import numpy as np

from cadence.actors.engine import GenerationResult


class ScriptedEngine:
    """Row i of a call answers with rows[i % len(rows)]; log-probs are 0."""

    def __init__(self, rows):
        self.rows = rows

    def generate(self, params, prompts, key, greedy=False):
        n, m = len(prompts), max(len(r) for r in self.rows)
        tokens = np.zeros((n, m), np.int32)
        lengths = np.zeros((n,), np.int32)
        for i in range(n):
            row = self.rows[i % len(self.rows)]
            tokens[i, :len(row)], lengths[i] = row, len(row)
        return GenerationResult(tokens, np.zeros((n, m), np.float32), lengths, 0.0, int(lengths.sum()))
