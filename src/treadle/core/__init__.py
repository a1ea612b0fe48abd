"""The pure scheduling core: plain data in, decisions out, time passed in as a number.

Nothing in this package performs I/O, awaits, or reads a clock; the live runtime and
the simulator both drive it.
"""
