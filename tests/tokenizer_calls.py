"""What reaches `tokenizers`: tokenizers made inside `watch_tokenizer` refuse, before any work, a text longer than
a bound in one call, so a test fails at once where a 50 MB line would be tokenised whole (~7 GB)."""

from __future__ import annotations

from t5forge.data import tokenizer as tokenizer_module
from t5forge.data.tokenizer import WINDOW_CHARS


class _Watched:
    def __init__(self, inner, limit: int, seen: list[int]):
        self.inner, self.limit, self.seen = inner, limit, seen

    def _check(self, texts) -> None:
        for text in texts:
            self.seen.append(len(text))
            assert len(text) <= self.limit, f"a text of {len(text)} characters was tokenised in one call"

    def encode(self, text, *args, **kwargs):
        self._check([text])
        return self.inner.encode(text, *args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self._check(texts)
        return self.inner.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def watch_tokenizer(monkeypatch, limit: int = WINDOW_CHARS) -> list[int]:
    """Every T5Tokenizer made from now on (in this process) refuses texts longer than `limit` characters per
    call; returns the list that collects the length of every text tokenised."""
    seen: list[int] = []
    pipeline = tokenizer_module._t5_pipeline
    monkeypatch.setattr(tokenizer_module, "_t5_pipeline", lambda *a, **k: _Watched(pipeline(*a, **k), limit, seen))
    return seen
