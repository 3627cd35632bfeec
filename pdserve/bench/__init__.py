"""``pdserve bench``: a serving benchmark for pdserve and any OpenAI-compatible server.

Modules: ``arrivals`` (when requests are sent), ``datasets`` (what they ask), ``client``
(HTTP streaming and timing), ``metrics`` (per-request records, aggregates, goodput),
``runner`` (runs and sweeps), ``report`` (tables, JSON), ``plot`` (PNG), ``stub`` (an
instant server for measuring the client), ``cli``.
"""
