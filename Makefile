# `make demo`: set up and run the main job. `make test`: set up and run the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean chromium

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/specdec pull smollm2-135m
	$(BIN)/specdec generate "Write a haiku about speculative decoding." --model smollm2-135m --max-new-tokens 48
	$(BIN)/specdec bench --model smollm2-135m --methods plain,prompt-lookup --prompts humanevalfix \
		--limit 3 --max-new-tokens 96 --out out/demo

test: $(STAMP) chromium
	$(BIN)/python -m pytest -q

chromium:  # Debian's chromium for the race page's browser test (tests/test_race_browser.py)
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)

clean:
	rm -rf $(VENV) build *.egg-info
