"""`search`: BM25 retrieval over a local document corpus, in pure Python.

Deterministic by construction: the tokenizer is a fixed regex with a fixed stop
list, scores are computed in document order, and ties are broken by the document's
position in the corpus, so the same query over the same corpus always returns the
same hits in the same order (no hash-order or float-summation-order dependence).

Limits: the whole index lives in memory (postings as dicts); fine for corpora of
up to ~10^5 short documents. No stemming, no phrase queries.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.envs.tools.base import (
    DEFAULT_MAX_OUTPUT_CHARS,
    Tool,
    ToolContext,
    ToolReplay,
    ToolResult,
    clip,
)

_TOKEN = re.compile(r"[a-z0-9]+")
STOPWORDS = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "by", "did", "do", "does", "for", "from", "has",
    "have", "he", "her", "his", "how", "in", "is", "it", "its", "of", "on", "or", "she", "that",
    "the", "their", "they", "this", "to", "was", "were", "what", "when", "where", "which", "who",
    "whom", "whose", "why", "with"))


@dataclass(frozen=True, slots=True)
class Document:
    """One searchable document."""

    doc_id: str  # stable id, shown in hits
    title: str
    text: str


def tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric tokens without stop words."""
    return [t for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]


class BM25Index:
    """Okapi BM25 (k1, b) over title + text of each document."""

    def __init__(self, documents: Iterable[Document], *, k1: float = 1.5,
                 b: float = 0.75) -> None:
        self.documents: list[Document] = list(documents)
        ids = [d.doc_id for d in self.documents]
        if len(set(ids)) != len(ids):
            raise ValueError("document ids must be unique")
        self.k1 = k1
        self.b = b
        self._postings: dict[str, list[tuple[int, int]]] = {}  # term -> [(doc index, tf)]
        self._lengths: list[int] = []
        for index, doc in enumerate(self.documents):
            counts = Counter(tokenize(f"{doc.title} {doc.text}"))
            self._lengths.append(sum(counts.values()))
            for term in sorted(counts):
                self._postings.setdefault(term, []).append((index, counts[term]))
        n = len(self.documents)
        self._avg_length = (sum(self._lengths) / n) if n else 0.0
        self._idf = {term: math.log(1.0 + (n - len(p) + 0.5) / (len(p) + 0.5))
                     for term, p in self._postings.items()}

    def search(self, query: str, k: int = 5) -> list[tuple[Document, float]]:
        """The top `k` documents for `query` with their scores, best first."""
        scores: dict[int, float] = {}
        for term in sorted(set(tokenize(query))):  # sorted: a fixed summation order
            idf = self._idf.get(term)
            if idf is None:
                continue
            for index, tf in self._postings[term]:
                norm = self.k1 * (1 - self.b + self.b * self._lengths[index] / self._avg_length)
                scores[index] = scores.get(index, 0.0) + idf * tf * (self.k1 + 1) / (tf + norm)
        ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]
        return [(self.documents[i], score) for i, score in ranked]


def documents_from_records(records: Iterable[Mapping[str, Any]]) -> list[Document]:
    """Documents from dicts with "id", "text" and optional "title" (the corpus JSONL format)."""
    out = []
    for n, record in enumerate(records, 1):
        doc_id, text = record.get("id"), record.get("text")
        if not isinstance(doc_id, str) or not isinstance(text, str):
            raise ValueError(f"document {n}: needs string fields 'id' and 'text'")
        title = record.get("title", "")
        out.append(Document(doc_id, title if isinstance(title, str) else str(title), text))
    return out


class SearchTool(Tool):
    """Searches a fixed corpus; runs on the host (no code is executed)."""

    replay = ToolReplay.NONE  # resumed: a search of a fixed corpus changes nothing

    def __init__(self, index: BM25Index | Sequence[Document], *, default_k: int = 5,
                 max_k: int = 10, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> None:
        self.index = index if isinstance(index, BM25Index) else BM25Index(index)
        self.default_k = default_k
        self.max_k = max_k
        self.max_output_chars = max_output_chars

    @property
    def name(self) -> str:
        return "search"

    @property
    def description(self) -> str:
        return ("Search the document collection with keywords and return the best matching "
                "documents (id, title, text). Search again with names you found to follow "
                "a chain of facts.")

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object",
                "properties": {
                    "query": {"type": "string", "minLength": 1, "maxLength": 1000},
                    "k": {"type": "integer", "minimum": 1, "maximum": self.max_k,
                          "description": f"number of results (default {self.default_k})"},
                },
                "required": ["query"], "additionalProperties": False}

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        hits = self.index.search(arguments["query"], arguments.get("k", self.default_k))
        if not hits:
            return ToolResult(output="no documents match; try other keywords")
        text = "\n\n".join(f"[{doc.doc_id}] {doc.title}\n{doc.text}" for doc, _ in hits)
        return ToolResult(output=clip(text, self.max_output_chars))
