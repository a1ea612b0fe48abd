"""A small fictional world, generated from a fixed seed, and its documents.

Countries, cities, rivers, people, companies and books with consistent facts
(a person's city is in one country, a company's founder was born before it was
founded...). Every name is made of invented syllables, so nothing can be answered
from a model's memory of the real world; every person's surname, city, river,
country and company name is unique, so each question has exactly one answer.

`build_world(seed)` is deterministic (one `random.Random` stream, lists in a fixed
order); `documents(world)` renders one short document per entity (about 300).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from treadle.envs.tools.search import Document

_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "r", "s", "st",
           "t", "th", "v", "vr", "z", "sh", "h", "j", "qu", "c", "cl", "fl", "tr", "w")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou", "y", "ei")
_CODAS = ("", "", "n", "r", "l", "s", "th", "m", "nd", "rk", "x", "sk")
_FIRST = ("Ada", "Bren", "Cato", "Dalia", "Eskil", "Fenna", "Gorm", "Hilde", "Ivo", "Juna",
          "Kasimir", "Liesl", "Mirek", "Nerys", "Oskar", "Pella", "Quill", "Runa", "Soren",
          "Tilde", "Ulf", "Vesna", "Wendel", "Xenia", "Yorick", "Zelda", "Aurel", "Brisa",
          "Corvin", "Dagny")
_PROFESSIONS = ("engineer", "chemist", "architect", "novelist", "economist", "botanist",
                "cartographer", "physician", "composer", "mathematician", "astronomer",
                "shipbuilder")
_INDUSTRIES = ("textile", "shipping", "software", "pharmaceutical", "glassmaking", "aerospace",
               "publishing", "mining", "robotics", "food processing")
_COMPANY_SUFFIX = ("Works", "Labs", "Foundry", "Systems", "Holdings", "Dynamics", "Mills",
                   "Instruments")
_ADJECTIVES = ("Silent", "Amber", "Hollow", "Crimson", "Distant", "Gilded", "Restless",
               "Northern", "Broken", "Patient", "Luminous", "Iron", "Quiet", "Salt", "Winter")
_NOUNS = ("Harbor", "Orchard", "Lantern", "Meridian", "Archive", "Compass", "Tide", "Garden",
          "Engine", "Bridge", "Cartographer", "Furnace", "Atlas", "Signal", "Vineyard")


@dataclass(slots=True)
class Country:
    name: str
    currency: str
    capital: str = ""  # a City name
    cities: list[str] = field(default_factory=list)


@dataclass(slots=True)
class City:
    name: str
    country: str
    river: str
    founded: int
    population: int


@dataclass(slots=True)
class Person:
    name: str
    surname: str
    born: int
    city: str
    profession: str


@dataclass(slots=True)
class Company:
    name: str
    founder: str  # a Person name
    founded: int
    city: str
    industry: str


@dataclass(slots=True)
class Book:
    title: str
    author: str
    year: int


@dataclass(slots=True)
class World:
    countries: list[Country]
    cities: dict[str, City]
    rivers: dict[str, int]  # river -> length in km
    people: dict[str, Person]
    companies: dict[str, Company]
    books: dict[str, Book]


class _Names:
    """Unique invented words: no two entities share a name (or a surname)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        while True:
            parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS)
                     for _ in range(syllables)]
            word = ("".join(parts) + self.rng.choice(_CODAS)).capitalize()
            if word not in self.used and 4 <= len(word) <= 12:
                self.used.add(word)
                return word


def build_world(seed: str = "treadle-world-v1") -> World:
    """The world for `seed`; the same in every process and Python version."""
    rng = random.Random(seed)
    names = _Names(rng)
    rivers = {f"{names.word(2)} River": rng.randint(80, 2400) for _ in range(12)}
    river_names = list(rivers)
    countries: list[Country] = []
    cities: dict[str, City] = {}
    for _ in range(10):
        country = Country(names.word(rng.choice((2, 3))), f"{names.word(2).lower()}")
        for k in range(4):
            city = City(names.word(rng.choice((2, 3))), country.name, rng.choice(river_names),
                        rng.randint(900, 1850), rng.randint(20, 2500) * 1000)
            cities[city.name] = city
            country.cities.append(city.name)
            if k == 0:
                country.capital = city.name
        countries.append(country)
    city_names = list(cities)
    people: dict[str, Person] = {}
    for _ in range(110):
        surname = names.word(rng.choice((2, 3)))
        person = Person(f"{rng.choice(_FIRST)} {surname}", surname, rng.randint(1890, 1990),
                        rng.choice(city_names), rng.choice(_PROFESSIONS))
        people[person.name] = person
    founders = rng.sample(list(people), 70)
    companies: dict[str, Company] = {}
    for founder in founders:
        name = f"{names.word(2)} {rng.choice(_COMPANY_SUFFIX)}"
        born = people[founder].born
        companies[name] = Company(name, founder, born + rng.randint(22, min(55, 2020 - born)),
                                  rng.choice(city_names), rng.choice(_INDUSTRIES))
    books: dict[str, Book] = {}
    authors = [p for p in people if p not in set(founders)]
    while len(books) < 60:
        title = f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
        if title in books:
            continue
        author = rng.choice(authors)
        born = people[author].born
        books[title] = Book(title, author, born + rng.randint(25, min(70, 2024 - born)))
    return World(countries, cities, rivers, people, companies, books)


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def documents(world: World) -> list[Document]:
    """One document per entity, with a few phrasings chosen by a fixed-seed stream."""
    rng = random.Random("treadle-world-docs-v1")
    docs: list[Document] = []
    for i, c in enumerate(world.countries):
        docs.append(Document(f"country-{i:02d}", c.name, (
            f"{c.name} is a country whose capital is {c.capital}. Its other cities include "
            f"{', '.join(c.cities[1:])}. The currency of {c.name} is the {c.currency}.")))
    for i, city in enumerate(world.cities.values()):
        verb = rng.choice(("lies on", "is built along", "straddles"))
        docs.append(Document(f"city-{i:03d}", city.name, (
            f"{city.name} is a city in {city.country}. It {verb} the {city.river} and was "
            f"founded in {city.founded}. About {city.population:,} people live there.")))
    for i, (river, length) in enumerate(world.rivers.items()):
        through = sorted(c.name for c in world.cities.values() if c.river == river)
        places = ", ".join(through) if through else "no major city"
        docs.append(Document(f"river-{i:02d}", river, (
            f"The {river} is {length} km long. Cities on its banks: {places}.")))
    companies_by_founder = {c.founder: c for c in world.companies.values()}
    books_by_author: dict[str, list[str]] = {}
    for book in world.books.values():
        books_by_author.setdefault(book.author, []).append(book.title)
    for i, p in enumerate(world.people.values()):
        text = rng.choice((
            f"{p.name} (born {p.born}) is {_a(p.profession)} from {p.city}.",
            f"{p.name} was born in {p.city} in {p.born} and became {_a(p.profession)}.",
            f"Born in {p.born} in the city of {p.city}, {p.name} worked as {_a(p.profession)}."))
        company = companies_by_founder.get(p.name)
        if company is not None:
            text += f" {p.surname} founded {company.name} in {company.founded}."
        for title in books_by_author.get(p.name, []):
            text += f" {p.surname} wrote {title}."
        docs.append(Document(f"person-{i:03d}", p.name, text))
    for i, co in enumerate(world.companies.values()):
        docs.append(Document(f"company-{i:03d}", co.name, (
            f"{co.name} is {_a(co.industry)} company headquartered in {co.city}. It was founded "
            f"in {co.founded} by {co.founder}.")))
    for i, b in enumerate(world.books.values()):
        docs.append(Document(f"book-{i:02d}", b.title, (
            f"{b.title} is a book by {b.author}, first published in {b.year}.")))
    return docs
