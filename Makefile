# The issue asks for `make demo`; every target delegates to dev.py, which needs only Python
# (it creates .venv and installs what the command needs on first use).

PYTHON ?= python3

.PHONY: demo test bench bench-transport pingpong stress

demo test bench bench-transport pingpong stress:
	$(PYTHON) dev.py $@
