# The two commands of the README: `make demo` and `make test`.
.PHONY: setup demo test test-fast docs bench

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/python examples/demo.py

test: setup
	.venv/bin/python -m pytest -q -ra -n 2 --dist loadfile

test-fast: setup
	.venv/bin/python -m pytest -q -ra -n 2 --dist loadfile -m "not slow"

docs: setup
	.venv/bin/mkdocs build --strict

bench: setup
	.venv/bin/python -m bench.run
