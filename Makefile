# The two commands of the README: `make demo` and `make test`.
.PHONY: setup demo test test-fast lint docs docs-serve bench local-s3

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/python examples/demo.py

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -ra -n 2 --dist loadfile

test-fast: setup
	.venv/bin/python -m pytest -q -ra -n 2 --dist loadfile -m "not slow"

lint: setup
	.venv/bin/ruff check .

docs: setup
	.venv/bin/mkdocs build --strict
	@echo "docs built: open site/index.html in a browser (works from disk), or run make docs-serve"

docs-serve: setup
	.venv/bin/mkdocs serve -a 127.0.0.1:8000

local-s3: setup
	.venv/bin/python -m cloudckpt.testing.serve s3 --bucket demo --env-file local-s3.env

bench: setup
	.venv/bin/python -m bench.run
