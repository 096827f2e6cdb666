"""Serving many requests at once (the lesson's Chapter 7): the packed forward (`batch`), the batched
engine that runs each request's round beside the others' (`engine`), the occupancy-aware scheduler that
spends only the measured idle budget on speculation (`scheduler`), the OpenAI-compatible HTTP app
(`app`) and its dashboard signals (`metrics`)."""
