"""Physical quantities as answers: a number with an optional unit, compared in SI.

`parse_quantity("2.5 kPa")` -> (2.5, "kPa"); `to_si(2.5, "kPa")` -> (2500.0, "pressure").
`quantity_matches(answer, gold_value, gold_unit, rel_tol)` accepts the answer in any
unit of the same kind (``0.5 km`` for a gold of 500 m); an answer without a unit
is read in the gold's unit; an unknown unit or one of another kind is wrong.

The table covers what the stem suite asks about (length, time, speed, acceleration,
mass, force, energy, power, pressure, volume, temperature in kelvin, amount,
concentration, current, voltage, resistance, charge). Temperatures in °C are not
converted (offset units are out of scope).
"""

from __future__ import annotations

import re

from treadle.envs.scoring import parse_number

# unit -> (kind, factor to the SI unit of that kind)
UNITS: dict[str, tuple[str, float]] = {
    "m": ("length", 1.0), "km": ("length", 1e3), "cm": ("length", 1e-2),
    "mm": ("length", 1e-3),
    "s": ("time", 1.0), "ms": ("time", 1e-3), "min": ("time", 60.0), "h": ("time", 3600.0),
    "m/s": ("speed", 1.0), "km/h": ("speed", 1 / 3.6), "cm/s": ("speed", 1e-2),
    "m/s^2": ("acceleration", 1.0),
    "kg": ("mass", 1.0), "g": ("mass", 1e-3), "mg": ("mass", 1e-6),
    "N": ("force", 1.0), "kN": ("force", 1e3),
    "J": ("energy", 1.0), "kJ": ("energy", 1e3), "MJ": ("energy", 1e6),
    "W": ("power", 1.0), "kW": ("power", 1e3), "mW": ("power", 1e-3),
    "Pa": ("pressure", 1.0), "kPa": ("pressure", 1e3), "MPa": ("pressure", 1e6),
    "bar": ("pressure", 1e5), "atm": ("pressure", 101325.0),
    "m^3": ("volume", 1.0), "L": ("volume", 1e-3), "mL": ("volume", 1e-6),
    "cm^3": ("volume", 1e-6),
    "K": ("temperature", 1.0),
    "mol": ("amount", 1.0), "mmol": ("amount", 1e-3),
    "mol/L": ("concentration", 1.0), "M": ("concentration", 1.0),
    "mmol/L": ("concentration", 1e-3), "mM": ("concentration", 1e-3),
    "A": ("current", 1.0), "mA": ("current", 1e-3),
    "V": ("voltage", 1.0), "mV": ("voltage", 1e-3), "kV": ("voltage", 1e3),
    "ohm": ("resistance", 1.0), "kohm": ("resistance", 1e3),
    "C": ("charge", 1.0), "mC": ("charge", 1e-3), "uC": ("charge", 1e-6),
}
_DERIVED = {"length/time": "speed", "speed/time": "acceleration", "energy/time": "power",
            "amount/volume": "concentration", "charge/time": "current"}
# Other spellings, mapped to the table's names (compared case-sensitively first:
# "mA" and "MA" are different units, "ms" and "Ms" too).
_ALIASES = {
    "meter": "m", "meters": "m", "metre": "m", "metres": "m", "sec": "s", "second": "s",
    "seconds": "s", "minutes": "min", "hours": "h", "hr": "h", "mps": "m/s",
    "m s^-1": "m/s", "ms^-1": "m/s", "m/s/s": "m/s^2", "m/s2": "m/s^2", "m/s²": "m/s^2",
    "m s^-2": "m/s^2", "kph": "km/h", "kmh": "km/h", "grams": "g", "gram": "g",
    "kilograms": "kg", "newton": "N", "newtons": "N", "joule": "J", "joules": "J",
    "watt": "W", "watts": "W", "pascal": "Pa", "pascals": "Pa", "l": "L", "liter": "L",
    "liters": "L", "litre": "L", "litres": "L", "ml": "mL", "m³": "m^3", "m3": "m^3",
    "cm³": "cm^3", "cm3": "cm^3", "kelvin": "K", "moles": "mol", "mole": "mol",
    "mol/l": "mol/L", "mol l^-1": "mol/L", "mol/dm^3": "mol/L", "amp": "A", "amps": "A",
    "ampere": "A", "amperes": "A", "volt": "V", "volts": "V", "Ω": "ohm", "ohms": "ohm",
    "kΩ": "kohm", "kiloohm": "kohm", "kiloohms": "kohm", "coulomb": "C", "coulombs": "C",
    "μC": "uC", "µC": "uC",
}


def canonical_unit(unit: str) -> str | None:
    """The table's name for `unit`, or None if unknown."""
    u = re.sub(r"\\(?:mathrm|text)\{([^{}]*)\}", r"\1", unit).strip().rstrip(".")
    u = u.replace("\\Omega", "Ω").replace("\\mu ", "μ").replace("\\mu", "μ").replace("\\,", " ")
    u = u.replace("{", "").replace("}", "").replace("·", " ").strip()
    if u in UNITS:
        return u
    if u in _ALIASES:
        return _ALIASES[u]
    lowered = u.lower()
    return _ALIASES.get(lowered) or next((k for k in UNITS if k.lower() == lowered), None)


def parse_quantity(text: str) -> tuple[float, str | None] | None:
    """(value, unit text or None) from e.g. "12.5 m/s", "3.1 \\times 10^{4} Pa"; None if no number.

    The number is the longest prefix that parses as one; the rest is the unit.
    """
    s = text.strip().replace("−", "-")
    s = re.sub(r"^[A-Za-z]\w*\s*=\s*", "", s).strip("$ ").rstrip(".").strip()
    if len(s) > 120:
        return None
    for cut in range(len(s), 0, -1):
        rest = s[cut:].strip()
        if rest[:1].isdigit() or rest[:1] in (".", ",", "/", "^"):
            continue  # the cut is inside the number
        value = parse_number(s[:cut])
        if value is not None:
            return float(value), (rest.strip("$ ") or None)
    return None


def to_si(value: float, unit: str) -> tuple[float, str] | None:
    """(value in SI, kind) or None for an unknown unit.

    A quotient of two known units ("km/s", "g/mL") is understood too; its kind is
    "<kind>/<kind>" unless `_DERIVED` names it (length/time is a speed).
    """
    name = canonical_unit(unit)
    if name is not None:
        kind, factor = UNITS[name]
        return value * factor, kind
    top, slash, bottom = unit.partition("/")
    if not slash:
        return None
    num, den = canonical_unit(top), canonical_unit(bottom)
    if num is None or den is None:
        return None
    (kind_n, f_n), (kind_d, f_d) = UNITS[num], UNITS[den]
    kind = f"{kind_n}/{kind_d}"
    return value * f_n / f_d, _DERIVED.get(kind, kind)


def quantity_matches(answer: str, gold_value: float, gold_unit: str,
                     rel_tol: float = 0.01) -> tuple[bool, str]:
    """(correct, why) for a numeric answer with an optional unit against the gold.

    `gold_unit` "" means dimensionless: the answer must then carry no unit.
    """
    parsed = parse_quantity(answer)
    if parsed is None:
        return False, f"no number found in {answer[:60]!r}"
    value, unit = parsed
    if not gold_unit:  # a dimensionless gold: compare plain numbers
        if unit is not None:
            return False, f"unexpected unit {unit!r} for a dimensionless answer"
        ok = abs(value - gold_value) <= rel_tol * abs(gold_value) + 1e-12
        return ok, f"{value:g} vs {gold_value:g}"
    gold = to_si(gold_value, gold_unit)
    if gold is None:
        raise ValueError(f"gold unit {gold_unit!r} is not in the unit table")
    got = to_si(value, unit if unit is not None else gold_unit)
    if got is None:
        return False, f"unknown unit {unit!r}"
    if got[1] != gold[1]:
        return False, f"{unit!r} is a unit of {got[1]}, the answer is a {gold[1]}"
    ok = abs(got[0] - gold[0]) <= rel_tol * abs(gold[0]) + 1e-12
    return ok, f"{value:g} {unit or gold_unit} vs {gold_value:g} {gold_unit}"
