"""The search suite: a consistent generated corpus, answerable multi-hop questions, F1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from envs_helpers import Backend, play, run

from treadle.envs import EnvConfigError, TaskFormatError, get_suite
from treadle.envs.suites._world import build_world, documents
from treadle.envs.suites.search import GENERATORS, SearchSuite, bundled_index, bundled_world
from treadle.envs.tools.search import tokenize
from treadle.types import Task

SUITE = SearchSuite()


def test_corpus_is_a_few_hundred_consistent_documents() -> None:
    world = bundled_world()
    docs = documents(world)
    assert 250 <= len(docs) <= 400 and len({d.doc_id for d in docs}) == len(docs)
    titles = [d.title for d in docs]
    assert len(set(titles)) == len(titles), "every entity has a unique name"
    surnames = [p.surname for p in world.people.values()]
    assert len(set(surnames)) == len(surnames)
    for company in world.companies.values():
        founder = world.people[company.founder]
        assert company.founded - founder.born >= 22 and company.founded <= 2020
        assert company.city in world.cities
    for city in world.cities.values():
        assert city.river in world.rivers
        assert city.name in next(c.cities for c in world.countries if c.name == city.country)
    # the generated world is the same when built again
    assert documents(build_world()) == docs


def test_questions_are_multi_hop_and_answerable_from_the_corpus() -> None:
    index = bundled_index()
    text = {d.doc_id: f"{d.title} {d.text}" for d in index.documents}
    tasks = SUITE.tasks(200, seed=2)
    assert {t.metadata["kind"] for t in tasks} == set(GENERATORS)
    for task in tasks:
        meta = task.metadata
        assert meta["hops"] >= 2 and meta["question"] in str(task.prompt)
        if meta["kind"] != "founder_age":  # a computed answer is in no document
            assert any(meta["answers"][0] in body for body in text.values()), meta
    # the first hop is found by searching the question itself
    for task in tasks[:40]:
        question = task.metadata["question"]
        top = index.search(question, 5)
        mentioned = [d for d, _ in top if d.title in question]
        assert mentioned, (question, [d.title for d, _ in top])


def test_reward_is_f1_and_reports_exact_match() -> None:
    task = SUITE.task_from_record({"id": "q", "question": "Which river?",
                                   "answers": ["Zuquex River", "Zuquex"]})
    full = SUITE.score_answer(task, "the Zuquex River")
    assert (full.reward, full.metrics) == (1.0, {"exact_match": 1.0, "f1": 1.0})
    partial = SUITE.score_answer(task, "It is the Zuquex River delta")
    assert partial.metrics["exact_match"] == 0.0 and 0.5 < partial.reward < 1.0
    assert partial.reward == partial.metrics["f1"]
    wrong = SUITE.score_answer(task, "Vess")
    assert (wrong.reward, wrong.metrics["exact_match"]) == (0.0, 0.0)
    assert SUITE.score_answer(task, None).reward == 0.0
    boxed = SUITE.score_answer(task, "Reasoning... so the answer is Zuquex.")
    assert boxed.metrics["exact_match"] == 1.0


def test_known_good_and_bad_answers_for_generated_questions() -> None:
    tasks = SUITE.tasks(100, seed=9)
    other = {t.metadata["answers"][0] for t in tasks}
    for task in tasks:
        gold = task.metadata["answers"][0]
        assert SUITE.score_answer(task, gold).reward == 1.0
        wrong = next(a for a in sorted(other) if set(tokenize(a)).isdisjoint(tokenize(gold)))
        assert SUITE.score_answer(task, wrong).reward == 0.0, (task.metadata, wrong)


def test_custom_corpus_and_question_file(tmp_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(json.dumps(d) for d in (
        {"id": "a", "title": "Orla", "text": "Orla is the sister of Bram."},
        {"id": "b", "title": "Bram", "text": "Bram lives in Tessaly."})) + "\n")
    suite = SearchSuite(corpus=corpus, python_tool=False)
    assert not suite.needs_sandbox(suite.task_from_record(
        {"id": "q", "question": "Where does Orla's brother live?", "answers": ["Tessaly"]}))
    assert [d.doc_id for d, _ in suite.index.search("Orla brother", 1)] == ["a"]
    with pytest.raises(EnvConfigError, match="bundled corpus"):
        suite.tasks(1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n')
    with pytest.raises(TaskFormatError, match="'id' and 'text'"):
        SearchSuite(corpus=bad)
    for record, fragment in (({"question": "q", "answers": []}, "answers"),
                             ({"question": "q", "answers": [""]}, "non-empty"),
                             ({"question": "q", "answers": ["a"], "hops": 0}, "hops")):
        with pytest.raises(TaskFormatError, match=fragment):
            suite.task_from_record({"id": "x", **record})


def test_search_without_a_sandbox_runs_end_to_end() -> None:
    suite = SearchSuite(python_tool=False)
    task = next(t for t in suite.tasks(30, seed=0) if t.metadata["kind"] == "company_country")
    company = task.metadata["question"].removeprefix("In which country is ").removesuffix(
        " headquartered?")
    world = bundled_world()
    city = world.companies[company].city

    async def episode() -> float:
        result, outputs = await play(suite, task, None, [
            ("search", {"query": company}),
            ("search", {"query": city, "k": 2}),
            ("submit_answer", {"answer": world.cities[city].country})])
        assert city in outputs[0].output and world.cities[city].country in outputs[1].output
        return result.reward

    assert run(episode()) == 1.0


@pytest.mark.integration
def test_search_end_to_end_with_the_python_tool(sandbox_backend: Backend) -> None:
    suite = get_suite("search")
    world = bundled_world()
    tasks = [t for t in suite.tasks(40, seed=4) if t.metadata["kind"] == "founder_age"][:1]
    tasks += [t for t in suite.tasks(40, seed=4) if t.metadata["hops"] == 3][:1]
    assert len(tasks) == 2
    for task in tasks:
        meta = task.metadata
        if meta["kind"] == "founder_age":
            company = world.companies[meta["question"].split(" was ")[-1].removesuffix(
                " founded?")]
            founder = world.people[company.founder]
            calls: list[tuple[str, dict[str, Any]]] = [
                ("search", {"query": company.name}), ("search", {"query": founder.name}),
                ("python", {"code": f"print({company.founded} - {founder.born})"})]
        else:
            calls = [("search", {"query": meta["question"]})]

        async def episode(task: Task, calls: list[tuple[str, dict[str, Any]]]
                          ) -> tuple[float, float]:
            _, outputs = await play(suite, task, sandbox_backend.backend, calls)
            answer = outputs[-1].output.strip() if calls[-1][0] == "python" else \
                task.metadata["answers"][0]
            good, _ = await play(suite, task, sandbox_backend.backend,
                                 [*calls, ("submit_answer", {"answer": answer})])
            bad, _ = await play(suite, task, sandbox_backend.backend,
                                [("submit_answer", {"answer": "Nowhere Land 1234"})])
            return good.reward, bad.reward

        good, bad = run(episode(task, calls))
        assert good == 1.0 and bad == 0.0, (sandbox_backend.label(), meta)
