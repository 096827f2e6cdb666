"""Draft sources, each behind the one small interface of `specdec.drafters.base.Drafter`."""

# decoding methods by name (the CLI lists them without importing torch)
METHODS = ("plain", "draft", "prompt-lookup", "recycling", "retrieval", "early-exit", "lookahead", "hybrid",
           "medusa", "eagle")
