# Two commands on a fresh machine: `make demo` and `make test` (each installs what it needs first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# GPU=1 installs the CUDA build of FBGEMM (fbgemm-gpu) instead of fbgemm-gpu-cpu.
REQUIREMENTS := requirements/$(if $(GPU),gpu,cpu).txt
STAMP := $(VENV)/.installed-$(if $(GPU),gpu,cpu)
DEMO_ROWS ?= 3000000
DEMO_DATA := data/synthetic_ctr

.PHONY: install demo test test-fast docs bench clean

install: $(STAMP)

$(STAMP): $(REQUIREMENTS) requirements/docs.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r $(REQUIREMENTS)
	$(PY) -m pip install --quiet --no-deps torchrec==1.9.2
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import torchrec, fbgemm_gpu, embedtrain; print('stack ok: torch', __import__('torch').__version__, 'torchrec', torchrec.__version__)"
	touch $@

$(DEMO_DATA)/metadata.json: $(STAMP)
	$(VENV)/bin/embedtrain datagen ctr --rows $(DEMO_ROWS) --out $(DEMO_DATA)

demo: $(STAMP) $(DEMO_DATA)/metadata.json
	$(VENV)/bin/embedtrain train configs/dlrm_synthetic.yaml --out runs/demo --overwrite

# The suite on TEST_WORKERS pytest-xdist workers, tests handed out one by one (`--dist load`: 568 s
# here, against 768 s grouped by module or marker); then the tests marked `serial` (deadlines of
# a few seconds), alone.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist load -m "not serial"
	$(PY) -m pytest -q -m serial

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist load -m "not slow"

# The documentation site (docs/, mkdocs.yml) into site/; the reference pages are generated from the
# code, and a broken link, anchor or an undocumented config key fails the build.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf runs data/synthetic_ctr .pytest_cache
