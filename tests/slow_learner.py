"""A real train step slowed down, so actors run as far ahead as admission lets them (tests only)."""
import time


class SlowLearner:
    """Wraps a train step: each update sleeps `seconds` first; everything else is the inner step's."""

    def __init__(self, inner, seconds):
        self.inner, self.seconds = inner, seconds

    def update(self, state, microbatches, num_tokens, **kw):
        time.sleep(self.seconds)
        return self.inner.update(state, microbatches, num_tokens, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)
