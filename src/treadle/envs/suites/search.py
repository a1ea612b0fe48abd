"""`search`: multi-hop questions over a bundled local corpus, answered with a BM25 tool.

The corpus (`_world.py`, ~300 short documents about invented countries, cities,
rivers, people, companies and books) is generated from a fixed seed, so its facts
are consistent and no answer can come from memory. Questions need two or three
lookups: "In which country was the author of The Amber Lantern born?" is
book -> author -> birth city -> country. Kinds: ``founder_city``,
``company_country``, ``person_company_city``, ``author_country``, ``company_river``,
``capital_founded``, ``birth_currency``, ``founder_age`` (a subtraction: the python
tool helps), ``born_first`` (a comparison).

Task format::

    {"id": "q1", "question": "Who founded Bikyx Works?", "answers": ["Xenia Draetiagrys"],
     "hops": 1, "kind": "founder"}

``question`` (string) and ``answers`` (one or more accepted strings) are required;
``hops`` and ``kind`` are optional labels. Users with their own documents pass
``SearchSuite(corpus=path)``: a JSONL of ``{"id", "title", "text"}`` (title
optional), which then replaces the bundled corpus (and `tasks()` is unavailable).

Reward: token F1 of the answer against the best gold (SQuAD normalisation:
case, punctuation and articles ignored); exact match is reported as a metric.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from treadle.envs.base import RewardResult
from treadle.envs.errors import EnvConfigError, TaskFormatError
from treadle.envs.records import check_keys, opt_str, read_jsonl, req_list, req_str, rng_for
from treadle.envs.scoring import exact_match, extract_answer, token_f1
from treadle.envs.suites._answer import AnswerSuite, count
from treadle.envs.suites._world import World, build_world, documents
from treadle.envs.tools.answer import SubmitAnswerTool
from treadle.envs.tools.base import Tool
from treadle.envs.tools.exec import PythonTool
from treadle.envs.tools.search import BM25Index, SearchTool, documents_from_records
from treadle.types import Task

QA = tuple[str, list[str], int]  # (question, accepted answers, hops)
PROMPT = (
    "Answer the question using the `search` tool, which searches a collection of documents; "
    "the facts are only in those documents. Questions need several searches: look up each "
    "entity you learn about. When you know the answer, call `submit_answer` with just the "
    "answer (a name, place or number).\n\nQuestion: {question}")


@functools.cache
def bundled_world() -> World:
    return build_world()


@functools.cache
def bundled_index() -> BM25Index:
    return BM25Index(documents(bundled_world()))


def _founder_city(w: World, rng: random.Random) -> QA:
    c = w.companies[rng.choice(sorted(w.companies))]
    return f"In which city was the founder of {c.name} born?", [w.people[c.founder].city], 2


def _company_country(w: World, rng: random.Random) -> QA:
    c = w.companies[rng.choice(sorted(w.companies))]
    return f"In which country is {c.name} headquartered?", [w.cities[c.city].country], 2


def _person_company_city(w: World, rng: random.Random) -> QA:
    c = w.companies[rng.choice(sorted(w.companies))]
    return (f"In which city is the company founded by {c.founder} headquartered?", [c.city], 2)


def _author_country(w: World, rng: random.Random) -> QA:
    b = w.books[rng.choice(sorted(w.books))]
    return (f"In which country was the author of {b.title} born?",
            [w.cities[w.people[b.author].city].country], 3)


def _company_river(w: World, rng: random.Random) -> QA:
    c = w.companies[rng.choice(sorted(w.companies))]
    river = w.cities[c.city].river
    return (f"Which river flows through the city where {c.name} has its headquarters?",
            [river, river.removesuffix(" River")], 2)


def _capital_founded(w: World, rng: random.Random) -> QA:
    country = rng.choice(w.countries)
    return (f"In what year was the capital of {country.name} founded?",
            [str(w.cities[country.capital].founded)], 2)


def _birth_currency(w: World, rng: random.Random) -> QA:
    p = w.people[rng.choice(sorted(w.people))]
    country = next(c for c in w.countries if c.name == w.cities[p.city].country)
    return (f"What is the currency of the country where {p.name} was born?",
            [country.currency], 3)


def _founder_age(w: World, rng: random.Random) -> QA:
    c = w.companies[rng.choice(sorted(w.companies))]
    return (f"How many years after the birth of its founder was {c.name} founded?",
            [str(c.founded - w.people[c.founder].born)], 2)


def _born_first(w: World, rng: random.Random) -> QA:
    while True:
        a, b = (w.people[n] for n in rng.sample(sorted(w.people), 2))
        if a.born != b.born:
            first = a if a.born < b.born else b
            return (f"Who was born first, {a.name} or {b.name}?", [first.name, first.surname], 2)


GENERATORS: dict[str, Callable[[World, random.Random], QA]] = {
    "founder_city": _founder_city, "company_country": _company_country,
    "person_company_city": _person_company_city, "author_country": _author_country,
    "company_river": _company_river, "capital_founded": _capital_founded,
    "birth_currency": _birth_currency, "founder_age": _founder_age, "born_first": _born_first,
}


class SearchSuite(AnswerSuite):
    """Multi-hop retrieval questions; see the module docstring."""

    name = "search"
    file_options = ("corpus",)
    answer_hint = "just the answer: a name, place or number"

    def __init__(self, *, corpus: str | Path | None = None, python_tool: bool = True,
                 python_timeout_s: float = 20.0, top_k: int = 5,
                 python_session: bool = False) -> None:
        super().__init__(python_tool=python_tool, python_timeout_s=python_timeout_s,
                         python_session=python_session)
        self.custom_corpus = corpus is not None
        if corpus is not None:
            try:
                docs = documents_from_records(r for _, r in read_jsonl(corpus))
                self.index = BM25Index(docs)
            except ValueError as e:
                raise TaskFormatError(f"{corpus}: {e}") from None
        else:
            self.index = bundled_index()
        self.top_k = top_k

    def tools(self, task: Task) -> list[Tool]:
        tools: list[Tool] = [SearchTool(self.index, default_k=self.top_k)]
        if self.python_tool:
            tools.append(PythonTool(timeout_s=self.python_timeout_s,
                                    session=self.python_session))
        tools.append(SubmitAnswerTool(self.answer_hint))
        return tools

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        """`n` (default 100) questions about the bundled corpus; task i depends on (seed, i)."""
        if self.custom_corpus:
            raise EnvConfigError("generated questions are about the bundled corpus; load your "
                                 "own questions with load_tasks() for a custom corpus")
        world = bundled_world()
        kinds = sorted(GENERATORS)
        out = []
        for i in range(count(n)):
            rng = rng_for(self.name, seed, i)
            kind = rng.choice(kinds)
            question, answers, hops = GENERATORS[kind](world, rng)
            out.append(self.task_from_record({"id": f"search-{seed}-{i:05d}", "question": question,
                                              "answers": answers, "hops": hops, "kind": kind}))
        return out

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        check_keys(record, {"question", "answers", "hops", "kind"})
        task_id, question = req_str(record, "id"), req_str(record, "question")
        answers = req_list(record, "answers")
        if not all(isinstance(a, str) and a.strip() for a in answers):
            raise TaskFormatError("field 'answers' must hold non-empty strings")
        metadata: dict[str, Any] = {"question": question, "answers": list(answers)}
        hops = record.get("hops")
        if hops is not None:
            if isinstance(hops, bool) or not isinstance(hops, int) or hops < 1:
                raise TaskFormatError("field 'hops' must be a positive integer")
            metadata["hops"] = hops
        kind = opt_str(record, "kind")
        if kind is not None:
            metadata["kind"] = kind
        return self._task(task_id, PROMPT.format(question=question), metadata)

    def score_answer(self, task: Task, answer: str | None) -> RewardResult:
        golds: list[str] = task.metadata["answers"]
        if answer is None or not answer.strip():
            return RewardResult(0.0, {"exact_match": 0.0, "f1": 0.0}, "no answer")
        predicted = extract_answer(answer)
        em, f1 = exact_match(predicted, golds), token_f1(predicted, golds)
        return RewardResult(f1, {"exact_match": em, "f1": f1},
                            f"answer {predicted[:60]!r} vs {golds[0]!r}")
